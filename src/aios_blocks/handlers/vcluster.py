"""Virtual cluster decisions (seed 003): request + snapshot -> a plan to commit, or a refusal.

Pure. The snapshot is the cluster's node views (each with its place, ``virtualCluster``, absent
for the primary's unassigned nodes) and its virtual cluster records. A plan is record writes and
node moves that ``state.vcluster.VClusterStore.commit`` applies atomically after re-checking
them (revisions, each node still where it was, idle, alive), and the ``changed`` events to
publish once it is applied. Nodes are chosen deterministically (sorted by id).

Also here: which nodes a block may use (``scope``), the one hook of virtual clusters into
placement: the gateway's filter rule and every resourceAllocator payload see only these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..policies.capacity import Nodes, node_fits
from ..schemas.records import Needs, NodeView
from ..schemas.vcluster import (
    PRIMARY,
    NodeMove,
    RecordWrite,
    VClusterChanged,
    VClusterCreate,
    VClusterKind,
    VClusterOp,
    VClusterRecord,
    VClusterRefused,
    VClusterRemove,
    VClusterUpdate,
    id_problem,
    job_cluster_id,
    limit_problems,
    node_type,
    replica_set_problems,
)

NodeViews = Mapping[str, NodeView]
Records = Mapping[str, VClusterRecord]
#: ids of this prefix are the job clusters' (``job_cluster_id``)
JOB_PREFIX = "job-"


@dataclass
class Plan:
    writes: list[RecordWrite] = field(default_factory=list)
    moves: list[NodeMove] = field(default_factory=list)
    events: list[VClusterChanged] = field(default_factory=list)

    @property
    def nodes(self) -> list[str]:
        """Nodes whose place changes (the inventory hint)."""
        return sorted({m.node for m in self.moves})


@dataclass
class Refusal:
    reason: str
    revision: int = 0


def place(view: NodeView) -> str:
    return str(view.get("virtualCluster") or PRIMARY)


def idle(view: NodeView) -> bool:
    """Nothing reserved on the node (no CPU, memory or GPU held by an instance)."""
    if abs(float(view.get("cpu", 0)) - float(view.get("cpu_free", 0))) > 1e-9:
        return False
    if int(view.get("memory", 0)) != int(view.get("memory_free", 0)):
        return False
    return not any(g.get("instances") for g in view.get("gpus") or [])


def types_of(nodes: NodeViews) -> set[str]:
    return {node_type(v) for v in nodes.values()}


def counts(nodes: NodeViews, ids: Mapping[str, str] | list[str]) -> dict[str, int]:
    """Alive nodes by type among ``ids``."""
    out: dict[str, int] = {}
    for nid in ids:
        v = nodes.get(nid)
        if v is not None and v.get("healthy"):
            t = node_type(v)
            out[t] = out.get(t, 0) + 1
    return out


def _pool(nodes: NodeViews, where: str, ntype: str, exclude: set[str]) -> list[str]:
    """Idle healthy nodes of type ``ntype`` in place ``where``, by id."""
    return sorted(
        nid for nid, v in nodes.items()
        if nid not in exclude and place(v) == where and v.get("healthy") and node_type(v) == ntype and idle(v)
    )


def _changed(rec: VClusterRecord, op: VClusterOp, moves: list[NodeMove], request_id: str = "", removed: bool = False,
             reason: str = "", published: bool = True) -> VClusterChanged:
    return VClusterChanged(
        rec.id, rec.cluster, op, rec, gen=rec.gen, revision=rec.revision + (1 if removed else 0),
        moved={m.node: [m.src, m.dst] for m in moves}, removed=removed, request_id=request_id, reason=reason,
        published=published,
    )


def _with(rec: VClusterRecord, **changes: Any) -> VClusterRecord:
    fields = {f: getattr(rec, f) for f in rec.__struct_fields__}
    fields.update(changes)
    return VClusterRecord(**fields)


def _describe(want: Mapping[str, int]) -> str:
    return ", ".join(f"{t}: {n}" for t, n in sorted(want.items())) or "none"


# -- create ---------------------------------------------------------------------------------------
def _limits_problems(limits: Mapping[str, Any] | None, replica_sets: Mapping[str, Any], divisible: bool) -> list[str]:
    """What is wrong with a virtual cluster's limits: only an indivisible one is autoscaled, so
    only it takes them (a divisible one's were stored and never used)."""
    if not limits:
        return []
    if divisible:
        return ["limits are for indivisible virtual clusters (a divisible one is not autoscaled)"]
    return limit_problems(limits, replica_sets)


def plan_create(req: VClusterCreate, gen: int, clusters: Mapping[str, Any], nodes: NodeViews, records: Records,
                held_by: str | None) -> Plan | Refusal:
    """Pre-checks (valid id, known cluster, valid replica sets, id free), then take idle healthy
    unassigned nodes of the primary per type; refused whole when any type is short."""
    problems = []
    if p := id_problem(req.vcluster_id):
        problems.append(p)
    elif req.vcluster_id.startswith(JOB_PREFIX):
        problems.append(f"virtual cluster ids starting with {JOB_PREFIX!r} are the job clusters'")
    if req.cluster_id not in clusters:
        problems.append(f"no cluster {req.cluster_id!r}")
    problems += replica_set_problems(req.replica_sets, types_of(nodes) if req.cluster_id in clusters else None)
    problems += _limits_problems(req.limits, req.replica_sets, req.divisible)
    if held_by is not None and held_by != req.cluster_id:
        problems.append(f"virtual cluster {req.vcluster_id!r} exists (in cluster {held_by})")
    elif req.vcluster_id in records:
        return Refusal(f"virtual cluster {req.vcluster_id!r} exists", records[req.vcluster_id].revision)
    if problems:
        return Refusal("; ".join(problems))
    want = {t: int(n) for t, n in req.replica_sets.items() if int(n) > 0}
    picked, short = _take(nodes, PRIMARY, want, set())
    if short:
        return Refusal(f"not enough idle healthy unassigned nodes in {req.cluster_id}: " + "; ".join(short))
    kind = VClusterKind.DIVISIBLE if req.divisible else VClusterKind.INDIVISIBLE
    rec = VClusterRecord(
        req.vcluster_id, req.cluster_id, kind, 1, {t: int(n) for t, n in req.replica_sets.items()},
        {nid: node_type(nodes[nid]) for nid in sorted(picked)}, request_id=req.request_id, gen=gen,
        limits={t: list(mm) for t, mm in req.limits.items()},
    )
    moves = [NodeMove(nid, PRIMARY, rec.id) for nid in sorted(picked)]
    return Plan([RecordWrite(rec.id, -1, rec)], moves, [_changed(rec, VClusterOp.CREATE, moves, req.request_id)])


def _take(nodes: NodeViews, where: str, want: Mapping[str, int], exclude: set[str]) -> tuple[list[str], list[str]]:
    picked: list[str] = []
    short: list[str] = []
    for t in sorted(want):
        pool = _pool(nodes, where, t, exclude)
        if len(pool) < want[t]:
            short.append(f"{t}: {want[t]} wanted, {len(pool)} available")
        else:
            picked += pool[: want[t]]
    return picked, short


# -- update ---------------------------------------------------------------------------------------
def plan_update(req: VClusterUpdate, nodes: NodeViews, records: Records, op: VClusterOp = VClusterOp.UPDATE,
                reason: str = "") -> Plan | Refusal:
    """Pre-checks (exists, not a job cluster, latest revision, kind unchanged, valid replica sets),
    then per type: scale up from the primary's idle unassigned nodes, scale down by idle nodes of
    its own (dead ones first). Refused whole when any type cannot be met."""
    if p := id_problem(req.vcluster_id):
        return Refusal(p)
    rec = records.get(req.vcluster_id)
    if rec is None:
        return Refusal(f"no virtual cluster {req.vcluster_id!r}")
    if req.revision != rec.revision:
        return Refusal(f"stale revision {req.revision}: the latest is {rec.revision} (get it and try again)", rec.revision)
    limits = rec.limits if req.limits is None else req.limits
    if problems := _update_problems(req, rec, nodes, limits):
        return Refusal("; ".join(problems), rec.revision)
    want = {t: int(n) for t, n in req.replica_sets.items()}
    have: dict[str, list[str]] = {}
    for nid, t in rec.nodes.items():
        have.setdefault(t, []).append(nid)
    new_nodes = dict(rec.nodes)
    moves: list[NodeMove] = []
    short = [why for t in sorted(set(want) | set(have))
             if (why := _update_type(rec, nodes, t, sorted(have.get(t, [])), want.get(t, 0), moves, new_nodes))]
    if short:
        return Refusal(f"cannot update {rec.id}: " + "; ".join(short), rec.revision)
    new = _with(rec, revision=rec.revision + 1, replica_sets=want, nodes=dict(sorted(new_nodes.items())),
                request_id=req.request_id, limits={t: list(mm) for t, mm in limits.items()})
    return Plan([RecordWrite(rec.id, rec.revision, new)], moves, [_changed(new, op, moves, req.request_id, reason=reason)])


def _update_problems(req: VClusterUpdate, rec: VClusterRecord, nodes: NodeViews, limits: Mapping[str, Any]) -> list[str]:
    problems = []
    if rec.kind == VClusterKind.JOB:
        problems.append("a job cluster cannot be updated (it lives and dies with its block)")
    if req.divisible is not None and req.divisible != (rec.kind == VClusterKind.DIVISIBLE):
        problems.append(f"a virtual cluster cannot change between divisible and indivisible (it is {rec.kind.value})")
    problems += replica_set_problems(req.replica_sets, types_of(nodes))
    problems += _limits_problems(limits, req.replica_sets, rec.kind != VClusterKind.INDIVISIBLE)
    return problems


def _update_type(rec: VClusterRecord, nodes: NodeViews, t: str, mine: list[str], target: int, moves: list[NodeMove],
                 new_nodes: dict[str, str]) -> str:
    """One node type of an update: its own dead nodes leave (job clusters replace theirs), then up
    from the primary's idle unassigned nodes or down by idle nodes of its own, to ``target``; the
    moves go to ``moves`` and ``new_nodes``. Returns why it cannot be met ("" when it can)."""
    alive = [n for n in mine if nodes.get(n, {}).get("healthy")]
    dead = [n for n in mine if n not in alive and place(nodes.get(n, {})) == rec.id]
    if target > len(alive):
        pool = _pool(nodes, PRIMARY, t, set())
        need = target - len(alive)
        if len(pool) < need:
            return f"{t}: {need} more wanted, {len(pool)} idle healthy unassigned in the primary"
        for nid in pool[:need]:
            moves.append(NodeMove(nid, PRIMARY, rec.id))
            new_nodes[nid] = t
    surplus = len(alive) - target
    free = [n for n in alive if place(nodes[n]) == rec.id and idle(nodes[n])]
    if surplus > len(free):
        busy = len(alive) - len(free)
        return f"{t}: {surplus} to give back, {len(free)} idle ({busy} busy or in job clusters)"
    for nid in dead:
        moves.append(NodeMove(nid, rec.id, PRIMARY, idle=False, alive=False))
        new_nodes.pop(nid)
    for nid in free[: max(0, surplus)]:
        moves.append(NodeMove(nid, rec.id, PRIMARY, idle=True, alive=False))
        new_nodes.pop(nid)
    return ""


# -- remove ---------------------------------------------------------------------------------------
def children(records: Records, vid: str) -> list[VClusterRecord]:
    return [r for r in records.values() if r.parent == vid]


def plan_remove(req: VClusterRemove, nodes: NodeViews, records: Records) -> Plan | Refusal:
    """Refused while anything is inside (a job cluster, an instance on one of its nodes); else
    every node goes back to the primary."""
    if p := id_problem(req.vcluster_id):
        return Refusal(p)
    rec = records.get(req.vcluster_id)
    if rec is None:
        return Refusal(f"no virtual cluster {req.vcluster_id!r}")
    if rec.kind == VClusterKind.JOB:
        return Refusal("a job cluster is removed with its block (blocks delete)", rec.revision)
    jobs = sorted(j.id for j in children(records, rec.id))
    if jobs:
        return Refusal(f"{rec.id} still holds job clusters: {', '.join(jobs)}", rec.revision)
    busy = sorted(nid for nid in rec.nodes if nid in nodes and not idle(nodes[nid]))
    if busy:
        return Refusal(f"{rec.id} still runs instances on {', '.join(busy[:10])}" + (" ..." if len(busy) > 10 else ""),
                       rec.revision)
    moves = [NodeMove(nid, rec.id, PRIMARY, idle=True, alive=False) for nid in sorted(rec.nodes) if nid in nodes]
    gone = _with(rec, request_id=req.request_id)
    return Plan([RecordWrite(rec.id, rec.revision, None)], moves,
                [_changed(gone, VClusterOp.REMOVE, moves, req.request_id, removed=True)])


# -- job clusters ---------------------------------------------------------------------------------
def plan_job_create(bid: str, gen: int, parent: str, replica_sets: Mapping[str, Any], cid: str, nodes: NodeViews,
                    records: Records) -> Plan | Refusal:
    """A job cluster for block ``bid`` carved from the undivided nodes of divisible ``parent``."""
    jid = job_cluster_id(bid)
    d = records.get(parent)
    if d is None:
        return Refusal(f"no virtual cluster {parent!r} in cluster {cid}")
    if d.kind != VClusterKind.DIVISIBLE:
        return Refusal(f"virtual cluster {parent!r} is {d.kind.value}: job clusters are carved from divisible ones")
    if problems := replica_set_problems(dict(replica_sets), types_of(nodes)):
        return Refusal("; ".join(problems))
    want = {t: int(n) for t, n in replica_sets.items() if int(n) > 0}
    picked, short = _take(nodes, parent, want, set())
    if short:
        return Refusal(f"not enough idle undivided nodes in {parent} for job cluster {jid}: " + "; ".join(short))
    rec = VClusterRecord(jid, cid, VClusterKind.JOB, 1, {t: int(n) for t, n in replica_sets.items()},
                         {nid: node_type(nodes[nid]) for nid in sorted(picked)}, parent=parent, block=bid, gen=gen)
    moves = [NodeMove(nid, parent, jid) for nid in sorted(picked)]
    return Plan([RecordWrite(jid, -1, rec)], moves, [_changed(rec, VClusterOp.JOB_CREATE, moves, reason=f"block {bid}")])


def plan_job_remove(rec: VClusterRecord, nodes: NodeViews, why: str) -> Plan | Refusal:
    """Destroy a job cluster: its nodes go back to its divisible cluster's undivided nodes (dead
    ones too: the divisible cluster replaces them). Refused while an instance is still on one."""
    busy = sorted(nid for nid in rec.nodes if nid in nodes and nodes[nid].get("healthy") and not idle(nodes[nid]))
    if busy:
        return Refusal(f"job cluster {rec.id} still runs instances on {', '.join(busy[:10])}", rec.revision)
    moves = [NodeMove(nid, rec.id, rec.parent, idle=bool(nodes[nid].get("healthy")), alive=False)
             for nid in sorted(rec.nodes) if nid in nodes and place(nodes[nid]) == rec.id]
    return Plan([RecordWrite(rec.id, rec.revision, None)], moves,
                [_changed(rec, VClusterOp.JOB_REMOVE, moves, removed=True, reason=why)])


# -- dead-node replenishment (seed 003, "Raylet Failover") ----------------------------------------
def plan_replenish(rec: VClusterRecord, nodes: NodeViews, records: Records) -> Plan | None:
    """Replace the dead nodes of ``rec`` by alive idle nodes of the same type, the seed's way:

    * divisible: from the primary; only its record changes ("store, do not publish");
    * indivisible: from the primary ("store and publish");
    * job: from the primary, then from its divisible cluster's undivided nodes; the job cluster
      is stored and published, its divisible cluster (which counts the job's nodes) stored.

    A replaced dead node leaves for the primary (where it stays dead until it comes back); one
    nothing can replace stays. A type below its replica count (a divisible cluster whose
    undivided node replaced a job cluster's dead one) is topped up from the primary the same way.
    ``None`` when nothing changes."""
    if rec.kind == VClusterKind.JOB and rec.parent not in records:
        return None
    parent = records.get(rec.parent) if rec.kind == VClusterKind.JOB else None
    moves: list[NodeMove] = []
    new_nodes = dict(rec.nodes)
    parent_nodes = dict(parent.nodes) if parent else {}
    take = _Taker(nodes, [PRIMARY] + ([parent.id] if parent else []))
    dead = sorted(n for n in rec.nodes if n in nodes and place(nodes[n]) == rec.id and not nodes[n].get("healthy"))
    for nid in dead:
        t = rec.nodes[nid]
        got = take(t)
        if got is None:
            continue
        new, where = got
        moves += [NodeMove(nid, rec.id, PRIMARY, idle=False, alive=False), NodeMove(new, where, rec.id)]
        new_nodes.pop(nid)
        new_nodes[new] = t
        if parent is not None:
            parent_nodes.pop(nid, None)
            parent_nodes[new] = t
    for t, n in sorted(rec.replica_sets.items()):
        for new, where in take.upto(t, n - sum(1 for x in new_nodes.values() if x == t)):
            moves.append(NodeMove(new, where, rec.id))
            new_nodes[new] = t
            if parent is not None:
                parent_nodes[new] = t
    if not moves:
        return None
    return _replenished(rec, parent, moves, new_nodes, parent_nodes)


class _Taker:
    """Alive idle nodes of a type, each taken once, from the first pool that has one."""

    def __init__(self, nodes: NodeViews, pools: list[str]) -> None:
        self.nodes, self.pools = nodes, pools
        self.taken: set[str] = set()

    def __call__(self, t: str) -> tuple[str, str] | None:
        for where in self.pools:
            pool = _pool(self.nodes, where, t, self.taken)
            if pool:
                self.taken.add(pool[0])
                return pool[0], where
        return None

    def upto(self, t: str, n: int) -> list[tuple[str, str]]:
        """Up to ``n`` nodes of type ``t`` (fewer when the pools run out)."""
        out: list[tuple[str, str]] = []
        for _ in range(n):
            got = self(t)
            if got is None:
                break
            out.append(got)
        return out


def _replenished(rec: VClusterRecord, parent: VClusterRecord | None, moves: list[NodeMove], new_nodes: dict[str, str],
                 parent_nodes: dict[str, str]) -> Plan:
    """The plan of a replenishment: the record (and its divisible parent's when it changed)."""
    new_rec = _with(rec, revision=rec.revision + 1, nodes=dict(sorted(new_nodes.items())))
    published = rec.kind != VClusterKind.DIVISIBLE
    gone = [m.node for m in moves if m.dst == PRIMARY]
    reason = ("replaced dead " + ", ".join(gone)) if gone else "topped up to its replica sets"
    writes = [RecordWrite(rec.id, rec.revision, new_rec)]
    events = [_changed(new_rec, VClusterOp.REPLENISH, moves, reason=reason, published=published)]
    if parent is not None and parent_nodes != parent.nodes:
        new_parent = _with(parent, revision=parent.revision + 1, nodes=dict(sorted(parent_nodes.items())))
        writes.append(RecordWrite(parent.id, parent.revision, new_parent))
        events.append(_changed(new_parent, VClusterOp.REPLENISH, [], reason=f"{reason} in job cluster {rec.id}",
                               published=False))
    return Plan(writes, moves, events)


# -- autoscaling within limits (beyond the seed) ---------------------------------------------------
def plan_grow(rec: VClusterRecord, nodes: NodeViews, records: Records, needs: Needs, share: bool,
              request_id: str, why: str) -> Plan | Refusal:
    """One more node for ``rec`` (indivisible, with ``limits``): of the first type below its max
    whose idle unassigned primary nodes can take one instance of ``needs``."""
    if rec.kind != VClusterKind.INDIVISIBLE or not rec.limits:
        return Refusal(f"{rec.id} does not autoscale (an indivisible cluster with limits does)")
    for t, (_, hi) in sorted(rec.limits.items()):
        if rec.replica_sets.get(t, 0) >= hi:
            continue
        if any(node_fits(nodes[n], needs.copy(), share) is not None for n in _pool(nodes, PRIMARY, t, set())):
            want = {**rec.replica_sets, t: rec.replica_sets.get(t, 0) + 1}
            req = VClusterUpdate(rec.id, rec.revision, want, request_id)
            return plan_update(req, nodes, records, VClusterOp.AUTOSCALE, f"grown by one {t}: {why}")
    return Refusal(f"{rec.id} cannot grow: no type below its max has an idle unassigned node that fits")


def plan_shrink(rec: VClusterRecord, nodes: NodeViews, records: Records, idle_long: set[str], request_id: str) -> Plan | None:
    """One node fewer for ``rec`` (with ``limits``): of a type above its min with a node that has
    stayed idle long enough (``idle_long``)."""
    if rec.kind != VClusterKind.INDIVISIBLE or not rec.limits:
        return None
    for t, (lo, _) in sorted(rec.limits.items()):
        if rec.replica_sets.get(t, 0) <= lo:
            continue
        if any(rec.nodes.get(n) == t for n in idle_long):
            want = {**rec.replica_sets, t: rec.replica_sets[t] - 1}
            got = plan_update(VClusterUpdate(rec.id, rec.revision, want, request_id), nodes, records, VClusterOp.AUTOSCALE,
                              f"shrunk by one {t}: idle")
            return got if isinstance(got, Plan) else None
    return None


def refusal(vid: str, op: VClusterOp, r: Refusal, request_id: str = "", cid: str = "") -> VClusterRefused:
    return VClusterRefused(vid, op, r.reason, request_id, r.revision, cid)


# -- placement: which nodes a block may use ---------------------------------------------------------
def place_of(ir: Mapping[str, Any], nodes: NodeViews) -> str:
    """Where block ``ir`` is placed in a cluster: its job cluster once carved (before that, the
    undivided nodes of its divisible cluster it will be carved from), its virtual cluster, or the
    primary's unassigned nodes ("") when it names none."""
    vid = str(ir.get("virtualClusterId") or "")
    if vid and ir.get("jobCluster"):
        jid = job_cluster_id(str(ir.get("blockId", "")))
        if part(nodes, jid):
            return jid
    return vid


def scope(ir: Mapping[str, Any], nodes: NodeViews) -> dict[str, NodeView]:
    """The node views block ``ir`` may use in this cluster (``place_of``). A cluster without
    virtual clusters is returned as it is (the same object, memos and all)."""
    return part(nodes, place_of(ir, nodes))


def part(nodes: NodeViews, where: str) -> dict[str, NodeView]:
    """The node views whose place is ``where`` (kept incrementally for the inventory's views; a
    plain dict is filtered each time, the same dict when no node of it is assigned)."""
    if not isinstance(nodes, Nodes):
        if not where and not any("virtualCluster" in v for v in nodes.values()):
            return nodes  # type: ignore[return-value]
        return {nid: v for nid, v in nodes.items() if place(v) == where}
    return _parts(nodes).part(where)


class _Parts:
    """Per inventory view memo: each node's place and the views of each place asked for, caught
    up in O(changes) from the ``capacity.Nodes`` change log."""

    def __init__(self, ref: Nodes):
        self.ref = ref
        self.places: dict[str, str] = {}
        self.assigned = 0
        self.parts: dict[str, Nodes] = {}
        self.seen = -1

    def update(self) -> None:
        ref = self.ref
        changed = ref.changed_since(self.seen) if self.seen >= 0 else None
        self.seen = ref.version
        if changed is None:
            self.places = {nid: place(v) for nid, v in ref.items()}
            self.assigned = sum(1 for p in self.places.values() if p)
            self.parts = {}
            return
        for nid in dict.fromkeys(changed):  # in change order: a part's order is not the hash seed's
            view = ref.get(nid)
            if view is not None and self.places.get(nid) == place(view):
                # a view replaced in the same place keeps its position in the part (and the
                # part's cached id order, ``Nodes.ids``, stays valid)
                if self.places[nid] in self.parts:
                    self.parts[self.places[nid]][nid] = view
                continue
            old = self.places.pop(nid, None)
            if old:
                self.assigned -= 1
            if old is not None and old in self.parts:
                self.parts[old].pop(nid, None)
            if view is None:
                continue
            new = place(view)
            self.places[nid] = new
            if new:
                self.assigned += 1
            if new in self.parts:
                self.parts[new][nid] = view

    def part(self, where: str) -> dict[str, NodeView]:
        self.update()
        if not where and not self.assigned:
            return self.ref
        got = self.parts.get(where)
        if got is None:
            got = self.parts[where] = Nodes({nid: self.ref[nid] for nid, p in self.places.items() if p == where})
        return got


#: one memo per inventory view (``capacity.Nodes``): a cluster each, so room for many clusters
_MEMO: dict[int, _Parts] = {}
_MEMO_MAX = 1024


def _parts(nodes: Nodes) -> _Parts:
    memo = _MEMO.get(id(nodes))
    if memo is None or memo.ref is not nodes:
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        memo = _MEMO[id(nodes)] = _Parts(nodes)
    return memo
