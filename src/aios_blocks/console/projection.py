"""The console's views, computed from a ``recovery.fold.Fold``: the state ``blocks recover``
rebuilds Redis from, so the live page and a past moment (the stream folded up to a sequence) are
one code path. Pure: no I/O; each function returns the JSON a view draws."""

from __future__ import annotations

import functools
import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Any, cast

import msgspec

from ..policies.builtin.frag import Workload
from ..policies.capacity import SHARE_UNITS
from ..policies.quota import tenant_of
from ..projections.explain import explain
from ..recovery.fold import Fold
from ..recovery.node_state import NodeState
from ..schemas.lifecycle import BlockStatus
from ..schemas.records import BlockIR
from ..state.views import describe_short, short_of
from ..trace.live import CLUSTER as TRACE_CLUSTER
from ..trace.live import COMPONENT_SHARED, COMPONENT_WHOLE

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


def _ir(block: dict[str, str]) -> BlockIR:
    return cast(BlockIR, _decoded(block.get("ir") or "{}"))  # (the IR the parser stored)


def block_name(ir: BlockIR) -> str:
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


_PENDING_S = frozenset(s.value for s in PENDING)
_FAILED_S = frozenset(s.value for s in FAILED)
_LIVE_S = frozenset(s.value for s in LIVE)


@dataclass
class Census:
    """One pass over the blocks at a sequence: counts by status, the waiting and failed ones, and
    the live blocks' task shapes weighted by wanted instances (what the overview and the map's
    stranded figure both need)."""

    by_status: Counter[str]
    waiting: list[str]
    failed: list[str]
    shapes: tuple[tuple[tuple[float, int, float, tuple[str, ...]], int], ...]


_census: list[tuple[int, int, Census]] = []


def census(f: Fold) -> Census:
    """``Census`` of ``f`` at its last sequence (the last one kept: the overview and the map of a
    sequence share it)."""
    if _census and _census[0][0] == id(f) and _census[0][1] == f.last_seq:
        return _census[0][2]
    by_status: Counter[str] = Counter()
    shapes: Counter[tuple[float, int, float, tuple[str, ...]]] = Counter()
    waiting, failed = [], []
    for bid, b in f.blocks.items():
        status = b.get("status", "")
        by_status[status] += 1
        if status in _LIVE_S:
            shape, least = _shape(b.get("ir") or "{}")
            desired = b.get("desired")
            shapes[shape] += (int(desired) or 1) if desired else least
            if status in _PENDING_S:
                waiting.append(bid)
        elif status in _FAILED_S:
            failed.append(bid)
    out = Census(by_status, waiting, failed, tuple(sorted(shapes.items())))
    _census[:] = [(id(f), f.last_seq, out)]
    return out


def workload(f: Fold) -> Workload:
    """The live blocks' task shapes, each weighted by its blocks' wanted instances: the workload
    FGD's fragmentation is measured against (``policies/builtin/frag.py``)."""
    return _workload(census(f).shapes)


class _Shaped(msgspec.Struct):
    """The part of an IR a task shape needs: decoding only it skips the rest of the text (~10x
    faster than the whole IR, which the first overview after a start did for every block)."""

    resources: dict[str, Any] | None = None
    minInstances: int | None = None


_shaped = msgspec.json.Decoder(_Shaped)


#: (past moments of a long stream ask the shapes of every block again: at 170,000 blocks a cache of
#: 65,536 missed on most of them, and the overview of a past moment decoded every IR again)
@functools.lru_cache(maxsize=262144)
def _shape(ir_text: str) -> tuple[tuple[float, int, float, tuple[str, ...]], int]:
    """A block's task shape (CPU, GPUs, gpuShare, GPU models) and its minInstances, per IR text."""
    try:
        ir = _shaped.decode(ir_text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        ir = _Shaped()
    r = ir.resources or {}
    return ((float(r.get("cpu", 0) or 0), int(r.get("gpus", 0) or 0), float(r.get("gpuShare", 0) or 0),
             tuple(r.get("gpuModels") or ())), int(ir.minInstances or 1))


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
        cid: {"id": cid, "nodes": 0, "healthy": 0, "drained": 0, "gpus": 0, "used": 0.0, "free": 0.0, "stranded": 0.0}
        for cid in f.clusters
    }
    for node in f.nodes.values():
        c = clusters.setdefault(node.cluster, {"id": node.cluster, "nodes": 0, "healthy": 0, "drained": 0, "gpus": 0,
                                               "used": 0.0, "free": 0.0, "stranded": 0.0})
        cells = node_cells(node)
        c["nodes"] += 1
        # (healthy: takes placements, as `blocks cluster list` counts it: a drained node is not)
        c["healthy"] += 1 if node.healthy and not node.drain else 0
        c["drained"] += 1 if node.drain else 0
        c["gpus"] += len(cells)
        used = sum(cells) / SHARE_UNITS
        c["used"] += used
        c["free"] += len(cells) - used
        c["stranded"] += stranded_units(node, cells, wl) / SHARE_UNITS
    rows = sorted(clusters.values(), key=lambda c: c["id"])
    for c in rows:
        for k in ("used", "free", "stranded"):
            c[k] = round(c[k], 2)
    totals = {k: round(sum(c[k] for c in rows), 2) for k in ("nodes", "healthy", "drained", "gpus", "used", "free", "stranded")}
    counted = census(f)
    by_status, waiting, failed = counted.by_status, counted.waiting, counted.failed
    newest = f.block_order.get
    pending = [_row(f, bid) for bid in heapq.nlargest(20, waiting, key=lambda bid: newest(bid, 0.0))]
    failures = [_row(f, bid) for bid in heapq.nlargest(20, failed, key=lambda bid: newest(bid, 0.0))]
    return {"seq": f.last_seq, "clusters": rows, "totals": totals, "blocks": dict(sorted(by_status.items())),
            "pending": pending, "failures": failures, "rates": recent or {}}


def _held_by(f: Fold, tenant: str, priority: str) -> dict[str, set[str]]:
    """Node -> the GPUs held by instances of the blocks of ``tenant`` and ``priority`` (class)."""
    out: dict[str, set[str]] = {}
    for bid, b in f.blocks.items():
        t, p = who(b.get("ir") or "{}")
        if (tenant and t != tenant) or (priority and p != priority):
            continue
        for inst in f.instances.get(bid, {}).values():
            node = inst.get("node")
            if node:
                out.setdefault(str(node), set()).update(str(g) for g in inst.get("gpus") or ())
    return out


def gpumap(f: Fold, label: str = "", tenant: str = "", priority: str = "") -> dict[str, Any]:
    """Every node as ``[id, cluster, model, healthy, rack, [thousandths held per GPU], stranded
    thousandths, [indices of the GPUs the filter's blocks hold], drained (1: ``blocks node
    drain``)]``, sorted by cluster, GPU model,
    rack and id: compact enough to draw 6,000 GPUs at once. ``label``: ``key=value``, only the
    nodes with that label; ``tenant`` / ``priority`` (a class): only the nodes where that
    tenant's (class's) blocks have instances, their GPUs marked. ``groups``: per cluster, GPU
    model and rack, its nodes and GPUs (the map's group titles)."""
    key, _, value = label.partition("=")
    held = _held_by(f, tenant, priority) if tenant or priority else None
    wl = workload(f)
    out: list[list[Any]] = []
    gpus = 0
    for nid, node in f.nodes.items():
        spec = _spec(node)
        labels = spec.get("labels") or {}
        if key and labels.get(key) != value:
            continue
        mine: list[int] = []
        if held is not None:
            if nid not in held:
                continue
            mine = [i for i, g in enumerate(node.gpu_total) if g in held[nid]]
        cells = node_cells(node)
        model = str((spec.get("gpus") or [{}])[0].get("model", "")) if cells else "cpu"
        gpus += len(cells)
        out.append([nid, node.cluster, model, 1 if node.healthy else 0, str(labels.get("rack", "")), cells,
                    round(stranded_units(node, cells, wl)), mine, 1 if node.drain else 0])
    out.sort(key=lambda n: (n[1], n[2], n[4], n[0]))
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for n in out:
        g = groups.setdefault((n[1], n[2], n[4]), {"cluster": n[1], "model": n[2], "rack": n[4], "nodes": 0, "gpus": 0})
        g["nodes"] += 1
        g["gpus"] += len(n[5])
    return {"seq": f.last_seq, "nodes": out, "gpus": gpus, "groups": list(groups.values()),
            "marked": sum(len(n[7]) for n in out)}


def gpumap_delta(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """What changed from the map ``old`` to ``new`` (both ``gpumap``'s): the nodes whose row
    differs or is new, and the ids of those gone; the page merges them into the map it holds."""
    was = {n[0]: n for n in old["nodes"]}
    now = {n[0] for n in new["nodes"]}
    return {**{k: v for k, v in new.items() if k != "nodes"}, "delta": True, "since": old["seq"],
            "nodes": [n for n in new["nodes"] if was.get(n[0]) != n], "gone": [nid for nid in was if nid not in now]}


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
    return {"seq": f.last_seq, "node": nid, "cluster": node.cluster, "healthy": node.healthy, "drain": node.drain,
            "labels": spec.get("labels") or {}, "cpu": node.cpu, "cpu_used": node.cpu_used or 0.0, "gpu": gpu or "", "gpus": gpus, "instances": instances}


def _row(f: Fold, bid: str) -> dict[str, Any]:
    b = f.blocks[bid]
    ir = _ir(b)
    tenant, priority = who(b.get("ir") or "{}")
    insts = f.instances.get(bid, {})
    return {"id": bid, "name": block_name(ir), "status": b.get("status", ""), "cluster": b.get("cluster", ""),
            "instances": len(insts), "running": sum(1 for i in insts.values() if i.get("status") == "running"),
            "desired": int(b.get("desired") or ir.get("minInstances") or 0), "component": ir.get("blockComponentURI", ""),
            "reason": _reason(b), "created": f.block_order.get(bid, 0.0), "tenant": tenant, "priority": priority,
            "short": _short(b)}


def _short(b: dict[str, str]) -> str:
    """A ready block's short condition in words ('' when whole; docs/reliability.md "Short blocks")."""
    d = short_of(b.get("short")) if b.get("status") == BlockStatus.READY else None
    return describe_short(d) if d else ""


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


@functools.lru_cache(maxsize=65536)
def who(ir_text: str) -> tuple[str, str]:
    """A block's tenant and priority class, per IR text: its ``tenant`` field when the IR has one,
    else its ``tenant`` label, else its virtual cluster (``policies.quota.tenant_of``: whom its
    quota counts); its ``priorityClass`` ("" for either when it has none)."""
    ir = _decoded(ir_text)
    tenant = ir.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        tenant = tenant_of(ir) or ""
    return str(tenant), str(ir.get("priorityClass") or "")


def blocks_page(f: Fold, q: str = "", status: str = "", cluster: str = "", page: int = 0, per: int = 50,
                label: str = "", policy: str = "", tenant: str = "", priority: str = "") -> dict[str, Any]:
    """One page of the blocks, newest first: ``q`` a substring of the id, name or component;
    ``status`` and ``cluster`` exact; ``label`` a ``key=value`` of its labels (a QoS class);
    ``policy`` one of its policies' URIs; ``tenant`` and ``priority`` (class) exact (``who``).
    Filtering reads the fold's records (each IR decoded once per distinct text), so it stays
    quick at 10,000+ blocks. ``tenants`` and ``priorities``: the values the filters offer."""
    per = max(1, min(per, 500))
    needle = q.lower()
    chosen = []
    tenants: set[str] = set()
    priorities: set[str] = set(f.priority_classes)
    for bid, b in f.blocks.items():
        t, p = who(b.get("ir") or "{}")
        tenants.add(t)
        priorities.add(p)
        if (tenant and t != tenant) or (priority and p != priority):
            continue
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
            "statuses": [s.value for s in BlockStatus], "clusters": sorted(f.clusters),
            "tenants": sorted(tenants - {""}), "priorities": sorted(priorities - {""})}


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


@functools.lru_cache(maxsize=65536)
def _trace_task(ir_text: str) -> tuple[bool, int, str]:
    """Whether the block is a live trace replay's task (its component), the GPU compute it asks
    in thousandths (``trace.workload.Task.milli_total``), and its resourceAllocator's URI."""
    ir = _decoded(ir_text)
    if ir.get("blockComponentURI") not in (COMPONENT_WHOLE, COMPONENT_SHARED):
        return False, 0, ""
    r = ir.get("resources") or {}
    share = float(r.get("gpuShare") or 0)
    milli = round(share * SHARE_UNITS) if share > 0 else int(r.get("gpus") or 0) * SHARE_UNITS
    policies = ir.get("policies") or {}
    rules = policies.values() if isinstance(policies, dict) else policies
    uri = next((str(p.get("policyRuleURI", "")) for p in rules if isinstance(p, dict) and p.get("name") == "resourceAllocator"), "")
    return True, milli, uri


def replay_curve(f: Fold) -> dict[str, Any]:
    """A live trace replay's GPU allocation rate against arrived GPU requests (both in % of the
    cluster ``trace``'s GPUs), at each 1 % arrived: ``trace.replay.Ledger``'s curve, computed
    from the stream. Its tasks are the blocks of the replay's components in the order they were
    created; the curve runs over those decided so far (ready: placed, failed: fits nowhere) up to
    the first one still undecided, so it grows as the replay goes and ends as the replay's own."""
    cm = sum(len(n.gpu_total) for n in f.nodes.values() if n.cluster == TRACE_CLUSTER) * SHARE_UNITS
    tasks = []
    policy = ""
    for bid, b in f.blocks.items():
        mine, milli, uri = _trace_task(b.get("ir") or "{}")
        if mine:
            tasks.append((f.block_order.get(bid, 0.0), bid, milli, b.get("status", "")))
            policy = policy or uri
    tasks.sort()
    arrived = allocated = placed = failed = 0
    curve: list[list[float]] = []
    nxt = 1
    for _, _, milli, status in tasks:
        if status == BlockStatus.READY:
            allocated += milli
            placed += 1
        elif status in FAILED:
            failed += 1
        else:
            break  # (not decided yet: the curve stops at the first such task)
        arrived += milli
        while cm and arrived * 100 >= nxt * cm:
            curve.append([nxt, round(100 * allocated / cm, 4)])
            nxt += 1
    return {"seq": f.last_seq, "cluster": TRACE_CLUSTER, "gpus": cm // SHARE_UNITS, "policy": policy, "blocks": len(tasks),
            "placed": placed, "failed": failed, "curve": curve,
            "arrived": round(100 * arrived / cm, 4) if cm else 0.0, "allocated": round(100 * allocated / cm, 4) if cm else 0.0}
