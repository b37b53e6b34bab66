"""The pending queue's decisions, pure (docs/priority.md): which waiting blocks a capacity event
sends back through selection, which one may preempt, which expired.

``walk`` reads the head of one scope's queue (priority desc, then age) and the clusters' node
views, and says, in order: ``retry`` a block whose whole gang (minInstances) fits now on what the
blocks released before it in this walk left (each one's take is applied to copies of the views);
``drop`` an entry whose block no longer waits (placed, deleted, re-created: the queue is an index,
cleaned lazily); ``preempt`` the first block that does not fit, when it may preempt. Backfill: a
lower block behind one that does not fit is released when it fits on the capacity as it is, since
the higher one cannot use that capacity now; but nothing behind a block whose preemption is in
flight (its victims draining) is released: the capacity they free is the preemptor's.

A block that was preempted and waits (``preempted_by``) never preempts: no cascades (kueue#13662).

A preemptor sent back through selection is out of the queue until it is placed; the room its
victims freed stays its own meanwhile (``Nominee``, kube-scheduler's nominatedNodeName): the walk
counts it as taken for every block of the preemptor's priority or lower, so the next pass (the
next victim's removal) does not give it to the victims or the blocks behind.

A ``ready`` block short of instances (``Entry.short``: the reconciler's ask for them placed
nothing) is walked as a pending placement of its priority: its missing instances, in its own
cluster (``with_short`` puts it in the head's order). It is never retried or dropped (it is not in
the queue): when they fit it is in ``ask`` (the walker asks for them), else it preempts as a
waiting block would, by the same rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..policies import capacity
from ..policies import quota as qp
from ..schemas.lifecycle import InstanceStatus
from ..schemas.priority import Quota
from ..schemas.records import BlockIR, BlockRecord, ClusterRecord, NodeView
from . import vcluster
from .gateway import filter_rule, share_of


@dataclass(frozen=True)
class Entry:
    """One queue entry as the walk reads it: the block's record (None: gone) and how many
    instances it still holds (a victim that drains waits for them to go)."""

    bid: str
    block: BlockRecord | None
    holds: int = 0
    #: a ``ready`` block short of instances (not a queue member): ``block`` is its record with
    #: ``minInstances`` the instances it is short of, placed in its own cluster only
    short: bool = False


@dataclass
class Walk:
    retry: list[tuple[str, int, str]] = field(default_factory=list)  # (bid, gen, cluster it fits in)
    drop: list[str] = field(default_factory=list)
    preempt: list[str] = field(default_factory=list)
    blocked_by: str = ""  # a preemptor whose victims drain: nothing behind it was released
    #: (bid, borrowers' blocks): the owner reclaims its quota by preempting them (InCohortReclamation)
    reclaim: list[tuple[str, list[str]]] = field(default_factory=list)
    #: (bid, gen, cluster): short ready blocks whose missing instances fit now (asked for, not retried)
    ask: list[tuple[str, int, str]] = field(default_factory=list)
    #: cluster -> the node copies the blocks in ``retry`` take (first fit): what is left for the
    #: block in ``preempt`` once they are placed is these over the views (``after``)
    work: dict[str, dict[str, NodeView]] = field(default_factory=dict)

    def after(self, views: Mapping[str, Mapping[str, NodeView]]) -> dict[str, dict[str, NodeView]]:
        """The views as the blocks released ahead of the one to preempt for leave them: a
        preemption plan made on the views alone counts on capacity those blocks are about to take."""
        return {cid: {**nodes, **self.work[cid]} if self.work.get(cid) else dict(nodes) for cid, nodes in views.items()}


#: how a quota-held block's reason starts (``gate``)
QUOTA_REASON = "quota: "


@dataclass
class QuotaView:
    """What the quota gate reads: the tenants' quotas and the running blocks' holdings (the walk
    adds each block it releases, so two blocks of one tenant are not both admitted on one room)."""

    quotas: Mapping[str, Quota]
    holdings: list[qp.Holding]
    #: the holdings are each tenant's total from the usage counters (one per tenant, not per block:
    #: ``workers.queue.quota_view``): admit, borrow and wait are decided on them as on the blocks';
    #: a ``reclaim`` names no real block, and the caller decides again on the blocks (``exact``)
    counted: bool = False

    def exact_needed(self, d: qp.Decision) -> bool:
        return self.counted and d.verdict is qp.Verdict.RECLAIM


def _fmt(u: qp.Usage) -> str:
    return ", ".join(f"{m}.{r}={v:g}" for m, a in sorted(u.items()) for r, v in sorted(a.items())) or "0"


def gate(ir: Mapping[str, Any], view: QuotaView | None) -> tuple[qp.Decision, str] | None:
    """The quota's verdict on the block's whole gang (minInstances) and the reason a waiting block
    shows (``quota: ...`` naming the tenant's nominal, used and borrowed); None: no quota applies."""
    if view is None or not view.quotas:
        return None
    tenant = qp.tenant_of(ir)
    if tenant is None or tenant not in view.quotas:
        return None
    request = qp.request_usage(ir.get("resources") or {}, max(int(ir.get("minInstances") or 0), 1))
    d = qp.decide(tenant, request, view.quotas, view.holdings)
    q = view.quotas[tenant]
    used = qp.usage_by_tenant(view.holdings).get(tenant, {})
    nominal = {m: {str(r): float(v) for r, v in a.items()} for m, a in q.nominal.items()}
    used = {m: {r: v for r, v in a.items() if r in nominal.get(m, {})} for m, a in used.items() if m in nominal}
    reason = (f"{QUOTA_REASON}tenant {tenant} {d.reason}; nominal {_fmt(nominal)}, used {_fmt(used)}, "
              f"borrowed {_fmt(qp.borrowed(used, q))}")
    return d, reason


def admitted(ir: Mapping[str, Any], bid: str, view: QuotaView | None) -> None:
    """Count a released block against its tenant's quota for the rest of the walk."""
    tenant = qp.tenant_of(ir)
    if view is not None and tenant is not None:
        request = qp.request_usage(ir.get("resources") or {}, max(int(ir.get("minInstances") or 0), 1))
        view.holdings.append(qp.Holding(bid, tenant, request, int(ir.get("priority") or 0)))


def gang_fit(ir: BlockIR, nodes: Mapping[str, NodeView], work: dict[str, NodeView]) -> bool:
    """Whether the block's minInstances fit on ``nodes`` (first fit, node order); on success
    ``work`` holds the copies of the nodes it took (the caller keeps them for the next block)."""
    needs, share = ir.get("resources") or {}, share_of(ir)
    taken: dict[str, NodeView] = {}
    for _ in range(max(int(ir.get("minInstances") or 0), 1)):
        for nid in sorted(nodes):
            node = taken.get(nid) or work.get(nid) or nodes[nid]
            gpus = capacity.node_fits(node, needs, share)
            if gpus is None:
                continue
            copy = taken.get(nid) or capacity.copy_node(node)
            capacity.take(copy, [g["id"] for g in gpus[: int(needs.get("gpus", 0))]], needs, share)
            taken[nid] = copy
            break
        else:
            return False
    work.update(taken)
    return True


def fits(ir: BlockIR, clusters: Mapping[str, ClusterRecord], views: Mapping[str, Mapping[str, NodeView]],
         work: dict[str, dict[str, NodeView]]) -> str:
    """The first cluster (the filter rule's order) where the whole gang fits now, on the views as
    this walk's releases left them (``work``: cluster -> node copies); '' when none."""
    # the views themselves where this walk took nothing yet (their fit index is kept per dict);
    # else the views with this walk's copies over them (``capacity.Overlay``: judged from the
    # views' own fit index and the copies, not node by node)
    merged: dict[str, dict[str, NodeView]] = {
        cid: capacity.overlay(views.get(cid, {}), work[cid]) if work.get(cid) else views.get(cid, {})  # type: ignore[arg-type,misc]
        for cid in clusters}
    passed, _ = filter_rule(ir.copy(), dict(clusters), merged)
    for entry in passed:
        cid = entry["cluster_id"]
        mine = work.setdefault(cid, {})
        if gang_fit(ir, vcluster.scope(dict(ir), merged[cid]), mine):
            return cid
    return ""


#: how long the room a preemption freed stays nominated for its preemptor once it is retried:
#: past it (a selection round that never ends) the room is everybody's again
NOMINATION_S = 30.0


@dataclass(frozen=True)
class Nominee:
    """A preemptor on its way through selection (retried, not placed yet) and the nodes its
    victims were on (``workers.queue``: the plan's): its room is held for it (``walk``)."""

    bid: str
    ir: BlockIR
    nodes: tuple[str, ...] = ()
    #: a short ready block's nominee (its missing instances): its own cluster, the only one it takes room in
    cluster: str = ""


def priority(ir: Mapping[str, Any]) -> int:
    return int(ir.get("priority") or 0)


def reserve(n: Nominee, clusters: Mapping[str, ClusterRecord], views: Mapping[str, Mapping[str, NodeView]],
            work: dict[str, dict[str, NodeView]]) -> str:
    """Take the nominee's whole gang in ``work`` (first fit on the nodes its victims freed, then
    anywhere, as ``fits``; a short block's in its own cluster only); the cluster it took it in, ''
    when it fits nowhere (its room is gone)."""
    if n.cluster:
        clusters = {n.cluster: clusters[n.cluster]} if n.cluster in clusters else {}
    if n.nodes:
        keep = set(n.nodes)
        for cid in sorted(clusters):
            mine = work.setdefault(cid, {})
            nodes = {nid: mine.get(nid) or v for nid, v in (views.get(cid) or {}).items() if nid in keep}
            if nodes and gang_fit(n.ir, vcluster.scope(dict(n.ir), nodes), mine):
                return cid
    return fits(n.ir, clusters, views, work)


def held(bid: str, ir: Mapping[str, Any], cid: str, cluster: ClusterRecord, nodes: Mapping[str, NodeView],
         nominated: Sequence[Nominee]) -> Mapping[str, NodeView]:
    """The cluster's node views as the placement of ``bid`` may use them: the room nominated for a
    preemptor of its priority or higher (not itself) taken (``reserve``, on copies)."""
    work: dict[str, dict[str, NodeView]] = {}
    for n in sorted(nominated, key=lambda n: (-priority(n.ir), n.bid)):
        if n.bid != bid and priority(n.ir) >= priority(ir):
            reserve(n, {cid: cluster}, {cid: nodes}, work)
    return {**nodes, **work[cid]} if work.get(cid) else nodes


#: how long a preemptor's mark (its victims draining) holds back the blocks behind it and its own
#: next preemption: past it (a walker stopped between the mark and the evictions, victims that
#: never drained) the block may preempt again
PREEMPT_HOLD_S = 120.0


def preempting(block: Mapping[str, Any], now: float) -> bool:
    """Whether the block's own preemption is under way: its mark (``<request>:<time>``) is recent."""
    mark = str(block.get("preempting") or "")
    if not mark:
        return False
    try:
        return now - float(mark.rsplit(":", 1)[-1]) < PREEMPT_HOLD_S
    except ValueError:
        return True


def may_preempt(block: Mapping[str, Any], now: float = 0.0) -> bool:
    """A waiting block may preempt unless it was itself preempted (no cascades), or already
    preempts (one preemption per block at a time)."""
    ir = block.get("ir") or {}
    return not block.get("preempted_by") and not preempting(block, now) and int(ir.get("priority") or 0) > 0


def _nominated_first(noms: list[Nominee], bid: str, ir: BlockIR, clusters: Mapping[str, ClusterRecord],
                     views: Mapping[str, Mapping[str, NodeView]], work: dict[str, dict[str, NodeView]]) -> None:
    """Before block ``bid`` is tried: the nominees (``noms``, highest first) of its priority or
    higher take their room, each once (popped)."""
    while noms and priority(noms[0].ir) >= priority(ir):
        n = noms.pop(0)
        if n.bid != bid:
            reserve(n, clusters, views, work)


def _walked(e: Entry, out: Walk) -> bool:
    """Whether the walk looks at entry ``e``: a waiting block whose instances do not drain, or a
    short block still ``ready``; an entry whose block no longer waits is dropped (``out.drop``)."""
    b = e.block
    if e.short:  # whole again, or gone: not a queue member, nothing to drop
        return b is not None and b.get("status") == "ready"
    if b is None or b.get("status") != "pending":
        out.drop.append(e.bid)
        return False
    return not e.holds  # a victim whose instances still drain: not placeable yet, blocks nobody


def short_of(ir: BlockIR, instances: Mapping[str, Mapping[str, Any]], replaced: str = "") -> BlockIR:
    """A ready block's missing instances as a pending placement: its IR with ``minInstances`` the
    instances it is short of (its live ones counted: not on their way out; ``replaced``, one that
    runs nowhere, left out); 0 once it is whole."""
    live = sum(1 for iid, r in instances.items() if iid != replaced and r.get("status") != InstanceStatus.REMOVING)
    return {**ir, "minInstances": max(int(ir.get("minInstances") or 0) - live, 0)}


def own(block: Mapping[str, Any], clusters: Mapping[str, ClusterRecord]) -> dict[str, ClusterRecord]:
    """The one cluster a short block's missing instances may go to: its own (scale steps place
    there); none when it is not known."""
    cid = str(block.get("cluster") or "")
    return {cid: clusters[cid]} if cid in clusters else {}


def with_short(head: Sequence[Entry], short: Sequence[Entry]) -> list[Entry]:
    """The entries a walk reads: the queue's head (in its order) and the short ready blocks, each
    before the first waiting block of its priority or lower (ahead of those of its own priority:
    it was placed before they came), the highest first, then by id."""
    out = list(head)
    for s in sorted(short, key=lambda e: (-priority((e.block or {}).get("ir") or {}), e.bid)):
        p = priority((s.block or {}).get("ir") or {})
        at = next((i for i, e in enumerate(out)
                   if not e.short and e.block is not None and priority(e.block.get("ir") or {}) <= p), len(out))
        out.insert(at, s)
    return out


def walk(entries: Sequence[Entry], clusters: Mapping[str, ClusterRecord],
         views: Mapping[str, Mapping[str, NodeView]], tried: frozenset[str] = frozenset(), now: float = 0.0,
         quota: QuotaView | None = None, nominated: Sequence[Nominee] = ()) -> Walk:
    """The walk of one scope's head (see the module docstring). It stops at the first block that
    may preempt (``preempt``: the caller asks the cluster's preemption policy, and walks again
    with that block in ``tried`` when the policy chose no victim): capacity a preemption plan
    counts on must not go to a block behind it meanwhile.

    Quotas (``quota``) come first: a block its tenant's quota makes wait is skipped (it holds no
    one back: the room is not its to take); one whose tenant reclaims what borrowers hold is
    returned in ``reclaim`` (the walk stops there, as for a preemption), unless it is itself a
    waiting victim (no cascades) or its reclamation is under way (then nothing behind it goes).

    ``nominated``: preemptors retried and not placed yet; before the first block of a nominee's
    priority or lower, the nominee's room is taken (``reserve``), as if it still waited at its place."""
    out = Walk()
    work = out.work
    noms = sorted(nominated, key=lambda n: (-priority(n.ir), n.bid))
    for e in entries:
        b = e.block
        if not _walked(e, out):
            continue
        assert b is not None  # (``_walked``)
        ir: BlockIR = b.get("ir") or {}
        verdict = gate(ir, quota)
        if verdict is not None and verdict[0].verdict is qp.Verdict.WAIT:
            continue
        if verdict is not None and verdict[0].verdict is qp.Verdict.RECLAIM:
            if preempting(b, now):
                out.blocked_by = e.bid
                break
            if not b.get("preempted_by") and e.bid not in tried:
                out.reclaim.append((e.bid, list(verdict[0].victims)))
                break
            continue
        _nominated_first(noms, e.bid, ir, clusters, views, work)
        cid = fits(ir, own(b, clusters) if e.short else clusters, views, work)
        if cid:
            (out.ask if e.short else out.retry).append((e.bid, int(b.get("gen") or 0), cid))
            admitted(ir, e.bid, quota)
            continue
        if preempting(b, now):
            out.blocked_by = e.bid
            break
        if e.bid not in tried and may_preempt(b, now):
            out.preempt.append(e.bid)
            break
    return out


def deadline(ir: Mapping[str, Any], since: float, default_s: float) -> float:
    """When a block waiting since ``since`` fails (its ``maxPendingS``, else the default; 0: never)."""
    limit = float(ir["maxPendingS"]) if ir.get("maxPendingS") is not None else float(default_s)
    return round(since + limit, 3) if limit > 0 else 0.0


def waits(ir: Mapping[str, Any]) -> bool:
    """Whether a block that fits nowhere waits (``queue`` absent or true) or fails at once."""
    return ir.get("queue") is not False
