"""The fold: the stream's events, in order, -> the Redis state the workers would have left.

Pure (no I/O): ``Fold.apply`` takes one stored message at a time (subject, body, stream sequence,
timestamp); ``Fold.image()`` renders the state as Redis keys (``recovery.image``), which
``recovery.rebuild`` writes and ``recovery.image.digest`` hashes. Each rule mirrors the handler or
Lua script that wrote Redis when the event was published, including its compare-and-set guards,
so a stray or duplicate event changes nothing, exactly as it did live:

* block status follows the CAS of ``state.scripts.TRANSITION`` / ``CREATE_BLOCK`` (gen, allowed
  statuses);
* reservations and per-node/GPU usage follow ``RESERVE_GANG`` / ``RELEASE`` (amounts derived from
  the block's IR, exclusive GPUs taking their whole memory);
* instances, the affinity index and the policy registry follow ``state.store``.

The fold is a projection (``projections.base``): each rule is a method registered for its catalog
event with ``@on(E...)``, handed the payload decoded into the event's struct. A new stored event is
either folded (a method) or named in ``IGNORED``; ``tests/unit/test_projections.py`` fails otherwise.
Alongside the state, the fold records ``anomalies``: facts that should never happen (an instance
running on two nodes at once, a placement on a node that does not exist).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
from pydantic import ValidationError

from ..handlers import scaling
from ..handlers.gateway import share_of
from ..policies import quota as qp
from ..policies.affinity import uid
from ..policies.capacity import share_units
from ..projections.base import INDEX, Fact, Projection, on
from ..schemas import condition as cond
from ..schemas import events as ev
from ..schemas import lifecycle as lc
from ..schemas import priority as pr
from ..schemas import vcluster as vc
from ..schemas.catalog import ROOT, E, Event
from ..schemas.records import BlockIR, InstanceRecord
from ..schemas.spec import ID_RE, Node
from ..state import keys as k
from ..state import queue
from ..state.keys import node_key, res_key
from .fold_records import Gather, Reservation, VClusterDoc
from .image import Image, ZSet
from .node_state import NodeState, _num, dumps

_json = msgspec.json
_enc = msgspec.json.Encoder()

#: a block id can be reused once its block is in one of these (CREATE_BLOCK)
REUSABLE = tuple(sorted(lc.REUSABLE))
#: ``lc.into`` of each status (the table is constant; recomputed per event it was a tenth of the fold)
_into = functools.cache(lc.into)
#: the subjects of a block's events start with this
_BLOCK = f"{ROOT}.block."
#: each status's value (``Enum.value`` is a Python-level property: slow once per event)
_VALUE = {s: s.value for s in lc.BlockStatus}
_SELECTING, _SELECTING_ONLY = _VALUE[lc.BlockStatus.SELECTING], frozenset({lc.BlockStatus.SELECTING})
_GONE = frozenset({_VALUE[lc.BlockStatus.DELETING], _VALUE[lc.BlockStatus.DELETED]})


#: stored events the state does not depend on (each is read by another projection, or by none):
#: named here so that the completeness test (``tests/unit/test_projections.py``) holds the fold to
#: every stored event - a new one must be folded or added to this list
IGNORED: frozenset[Event[Any]] = frozenset({
    E.block_decision,  # a policy call no step event carries: recovery.inputs rebuilds its input
    E.block_autoscaled, E.block_autoscale_failed,  # what the autoscaler did: the scale.target after it
    E.block_allocation_failed, E.block_scale_failed, E.block_scale_down_failed, E.block_reassignment_failed,
    E.block_health_failed,  # a failed step changes nothing
    E.cluster_scale, E.cluster_scale_down,  # requests: their outcome is the placement
    E.node_instance_create, E.node_instance_restart, E.node_sidecar_stop,  # commands to agents: their reports count
    E.instance_failed, E.instance_unhealthy, E.instance_verdict,  # reports whose consequence has its own event
    E.node_dangling, E.node_inventory,  # what an agent runs: the controller's removes follow
    E.vcluster_create, E.vcluster_update, E.vcluster_remove, E.vcluster_refused,  # requests: vcluster.changed
    E.block_output,  # task outputs (AIOS_OUTPUTS): the side-cars' input, no state
    E.dead_letter, E.output_dead_letter,  # a message that kept failing (an output a side-car gave up on): no state
    E.dlq_replayed,  # a dead letter put back (its copy is folded as the original event it is): no state
    E.tenant_block_create,  # a tenant's create, in AIOS_INTAKE: the parser stores it in AIOS as block.submitted
    # issue 36: a victim's state comes with its own block.pending (preempted_by); the instances go
    # through node.instance.remove and instance.removed
    E.block_preempted,
    # issue 38: a move's claim is volatile (aios:meta:, state.moves); its instances' records come
    # with block.placement, node.instance.remove and instance.removed like any other
    E.block_move_requested, E.block_move_started, E.block_move_switched, E.block_move_completed, E.block_move_failed,
})


@dataclass
class Fold(Projection):
    """The stored stream -> the Redis state (see the module doc); one method per catalog event."""

    ignores: ClassVar[frozenset[Event[Any]]] = IGNORED

    components: dict[str, str] = field(default_factory=dict)
    clusters: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    blocks: dict[str, dict[str, str]] = field(default_factory=dict)
    block_order: dict[str, float] = field(default_factory=dict)
    instances: dict[str, dict[str, InstanceRecord]] = field(default_factory=dict)
    reservations: dict[tuple[str, str], Reservation] = field(default_factory=dict)
    #: (cluster, iid) -> what the reservation added to its tenant's quota usage counters
    #: (``state.keys.quota_usage_key``: RESERVE_GANG counts it, RELEASE takes it back)
    quota_res: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    aff_svc: dict[str, dict[str, str]] = field(default_factory=dict)
    aff_lease: dict[str, str] = field(default_factory=dict)
    #: node -> {iid: bid} (Store.put_instances: what an agent reconciles against)
    node_insts: dict[str, dict[str, str]] = field(default_factory=dict)
    policies: dict[str, dict[str, str]] = field(default_factory=dict)
    policy_versions: dict[tuple[str, int], dict[str, str]] = field(default_factory=dict)
    #: priority classes and tenants' quotas (docs/priority.md): name -> JSON, as ``state.priority``
    priority_classes: dict[str, str] = field(default_factory=dict)
    quotas: dict[str, str] = field(default_factory=dict)
    #: open gathers: (bid, gen, attempt) -> {expected, deadline, results, decided}
    gathers: dict[tuple[str, int, int], Gather] = field(default_factory=dict)
    #: a create's gen (its AIOS_INTAKE sequence, told by its ``submitted``) -> digest of its body
    #: (the parser stores it on the block)
    creates: dict[int, str] = field(default_factory=dict)
    #: (bid, gen, iid) -> nodes where it was reported added and not yet removed
    running_on: dict[tuple[str, int, str], set[str]] = field(default_factory=dict)
    #: (block, gen) whose ``deleted`` fact was stored before the block itself (``on_deleted``)
    deleted_ahead: set[tuple[str, int]] = field(default_factory=set)
    #: (cluster, vid) -> [cluster index of its last change, record JSON or None once removed]
    vclusters: dict[tuple[str, str], list[Any]] = field(default_factory=dict)
    anomalies: list[str] = field(default_factory=list)
    events: int = 0
    last_seq: int = 0
    #: block -> (time, subject tail) of its latest stored event: how long it has not moved
    #: (``blocks check`` reports blocks in flight that stopped moving; not part of the image)
    last_event: dict[str, tuple[float, str]] = field(default_factory=dict)

    # -- entry point -----------------------------------------------------------------------------
    def apply(self, subject: str, raw: bytes, seq: int = 0, ts: float = 0.0) -> None:
        """Fold one stored message. Messages the state does not depend on are skipped undecoded."""
        self.events += 1
        if seq > self.last_seq:
            self.last_seq = seq
        found = INDEX.parse(subject)
        if found is None:
            return
        event, tokens = found
        bid = tokens.get("bid")
        if bid is not None and event.pattern.startswith(_BLOCK):
            self.last_event[bid] = (ts, subject[len(_BLOCK) + len(bid) + 1:])
        self.feed_event(event, tokens, subject, raw, seq, ts)

    @on(E.block_submitted)
    def on_submitted(self, m: Fact[ev.Submitted]) -> None:
        """A create, as the parser stored it from AIOS_INTAKE."""
        self.creates[m.data.gen] = m.data.digest or ""
        if ID_RE.match(m.tokens["bid"]):
            self.block_order.setdefault(m.tokens["bid"], m.ts)

    @on(E.block_create)
    def on_create(self, m: Fact[bytes]) -> None:
        """A stream of a version before AIOS_INTAKE: the create itself, its sequence its gen."""
        self.creates[m.seq] = _digest(m.data)
        self.block_order.setdefault(m.tokens["bid"], m.ts)

    # -- blocks ----------------------------------------------------------------------------------
    def _block(self, bid: str, gen: Any) -> dict[str, str] | None:
        b = self.blocks.get(bid)
        if b is None or (gen is not None and b.get("gen") != str(gen)):
            return None
        return b

    def _step(self, bid: str, gen: Any, step: lc.Step, **fields: str) -> bool:
        """The worker's step, by the same table its CAS script took (``schemas.lifecycle``)."""
        rule = lc.TRANSITIONS[step]
        return self._move(bid, gen, rule.sources, rule.target, **fields)

    def _reach(self, bid: str, gen: Any, target: lc.BlockStatus, **fields: str) -> bool:
        """An event says the block reached ``target``: from any status a step moves it there from."""
        return self._move(bid, gen, _into(target), target, **fields)

    def _move(self, bid: str, gen: Any, sources: frozenset[lc.BlockStatus], target: lc.BlockStatus, **fields: str) -> bool:
        b = self._block(bid, gen)
        if b is None or b.get("status") not in sources:
            return False
        b["version"] = str(int(b.get("version", "0")) + 1)
        b["status"] = _VALUE[target]
        if target != lc.BlockStatus.READY:
            b.pop(cond.FIELD, None)  # a short mark is a ready block's (the reconciler clears it)
        if fields:
            b.update(fields)
        return True

    def _create(self, bid: str, gen: int, fields: dict[str, str]) -> bool:
        cur = self.blocks.get(bid)
        if cur is not None:
            if cur.get("gen") == str(gen):
                return False
            if cur.get("status") not in REUSABLE:
                return False
        self.blocks[bid] = {**fields, "gen": str(gen), "digest": self.creates.get(gen, ""), "version": "1"}
        self.block_order.setdefault(bid, 0.0)
        if (bid, int(gen)) in self.deleted_ahead:  # its deleted fact came first (on_deleted)
            self.deleted_ahead.discard((bid, int(gen)))
            self._step(bid, gen, lc.Step.DELETE)
            self._reach(bid, gen, lc.BlockStatus.DELETED)
        return True

    @on(E.block_parsed)
    def on_parsed(self, m: Fact[ev.Parsed]) -> None:
        bid, d = m.tokens["bid"], m.data
        if d.attempt == 0:
            self._create(bid, d.gen, {"status": "parsed", "ir": dumps(d.ir or {}), "created": str(d.gen)})
            return
        b = self._block(bid, d.gen)  # back through selection after a failed allocation
        if b is not None and b.get("status") == "parsed":
            b["attempt"] = str(d.attempt)
        elif b is not None and b.get("status") == "pending":  # the queue walker's retry (workers/queue.py)
            self._step(bid, d.gen, lc.Step.RETRY, attempt=str(d.attempt), preempting="", reason="")
        elif b is not None and b.get("status") == _SELECTING and d.attempt > int(b.get("attempt", "0")):
            # the walker's retry stored before the block.pending of the WAIT it ended (the gateway's
            # wait: nothing else takes a selecting block to a later attempt): WAIT then RETRY, as
            # Redis took them; the late pending adds its own fields (``on_pending``)
            self._move(bid, d.gen, _SELECTING_ONLY, lc.BlockStatus.PARSED, attempt=str(d.attempt), preempting="", reason="")
        else:
            self._step(bid, d.gen, lc.Step.RESELECT, attempt=str(d.attempt))

    @on(E.block_rejected)
    def on_rejected(self, m: Fact[ev.Rejected]) -> None:
        bid = m.tokens["bid"]
        if not ID_RE.match(bid):  # a create on a subject with no valid id (aios.block._invalid): no block
            return
        self._create(bid, m.data.gen, {"status": "rejected", "reason": dumps(m.data.errors or [])[:2000]})

    @on(E.block_selection)
    def on_selection(self, m: Fact[ev.Selection]) -> None:
        bid, d = m.tokens["bid"], m.data
        b = self._block(bid, d.gen)
        if b is None or int(b.get("attempt", "0")) != d.attempt:
            return
        self._step(bid, d.gen, lc.Step.SELECT)
        if d.candidates:
            g = self._gather(bid, d.gen, d.attempt)
            g["expected"] = g["expected"] or list(d.candidates)
            g["deadline"] = g["deadline"] or float(d.deadline or 0)

    @on(E.block_dry_run_result)
    def on_result(self, m: Fact[ev.DryRunResult]) -> None:
        """One answer, stored apart by versions before the answers went into ``post_dry_run``."""
        d = m.data
        self._gather(m.tokens["bid"], d.gen, d.attempt)["results"][d.cluster_id] = {
            "score": d.score, "node_info": d.node_info or {}, "error": d.error, "placeable": d.placeable,
            "shortfall": d.shortfall,
        }

    @on(E.block_post_dry_run)
    def on_post_dry_run(self, m: Fact[ev.PostDryRun]) -> None:
        bid, d = m.tokens["bid"], m.data
        g = self._gather(bid, d.gen, d.attempt)
        g["decided"] = g["decided"] or "recovered"
        b = self._block(bid, d.gen)
        if b is None or int(b.get("attempt", "0")) != d.attempt or not d.cluster_id:
            return
        self._step(bid, d.gen, lc.Step.CHOOSE, cluster=d.cluster_id)

    @on(E.block_placement)
    def on_placement(self, m: Fact[ev.PlacementMade]) -> None:
        bid, d, seq = m.tokens["bid"], m.data, m.seq
        b = self._block(bid, d.gen)
        if b is None:
            self.anomalies.append(f"seq {seq}: placement for {bid} gen {d.gen}, which has no such block")
            return
        ir = _json.decode(b.get("ir", "{}"))
        if d.action == "allocation":
            self._step(bid, d.gen, lc.Step.RESERVE, cluster=d.cluster_id)
        insts = self.instances.setdefault(bid, {})
        for p in d.placements:
            iid, nid, gpus = p.instance_id, p.node_id, list(p.gpus)
            self._reserve(d.cluster_id, iid, bid, nid, gpus, ir, seq)
            node = self.nodes.get(nid)
            self.aff_svc.setdefault(uid(bid), {})[iid] = dumps([nid, node.rack() if node else ""])
            self.aff_lease[uid(iid)] = nid
            insts[iid] = {"node": nid, "gpus": gpus, "cluster": d.cluster_id, "status": "starting", "action": d.action,
                          "since": round(m.ts, 3)}
            self.node_insts.setdefault(nid, {})[iid] = bid

    @on(E.instance_added)
    def on_added(self, m: Fact[ev.InstanceEvent]) -> None:
        """Running, if it is the instance the block wants on that node (else the controller only
        sends a remove, see ``on_remove_command``)."""
        bid, d = m.tokens["bid"], m.data
        where = self.running_on.setdefault((bid, d.gen, d.instance_id), set())
        where.add(d.node_id)
        if len(where) > 1:
            self.anomalies.append(f"seq {m.seq}: instance {d.instance_id} of {bid} runs on {sorted(where)} at once")
        b = self._block(bid, d.gen)
        inst = self.instances.get(bid, {}).get(d.instance_id)
        if b is None or inst is None or inst["node"] != d.node_id or inst["status"] == "removing":
            return
        inst["status"] = "running"
        if d.endpoint:
            inst["endpoint"] = d.endpoint

    @on(E.instance_removed)
    def on_removed(self, m: Fact[ev.InstanceEvent]) -> None:
        """Removed for any reason (stopped, start failed, lost, evicted): release and forget it.
        Idempotent: a second ``removed`` finds nothing to release; a fact about an older
        generation of the block id, or about a copy on another node, changes nothing."""
        bid, d = m.tokens["bid"], m.data
        iid = d.instance_id
        self.running_on.get((bid, d.gen, iid), set()).discard(d.node_id)
        b = self.blocks.get(bid)
        if b is not None and b.get("gen") != str(d.gen):
            return
        inst = self.instances.get(bid, {}).get(iid)
        if inst is None or inst["node"] != d.node_id:
            return
        del self.instances[bid][iid]
        self._release(inst["cluster"], inst["node"], iid)
        self.node_insts.get(inst["node"], {}).pop(iid, None)
        svc = self.aff_svc.get(uid(bid))
        if svc is not None:
            svc.pop(iid, None)
        self.aff_lease.pop(uid(iid), None)

    @on(E.block_scale_target)
    def on_scale_target(self, m: Fact[ev.ScaleTarget]) -> None:
        """The controller's rule (``workers.controller.scale_target``, ``scripts.SET_DESIRED``): a
        live, placed block of that generation takes the clamped count unless it holds a later one."""
        d = m.data
        b = self._block(m.tokens["bid"], d.gen or None)
        if b is None or b.get("status") not in lc.LIVE or not b.get("cluster"):
            return
        if int(b.get("desired_seq", "0")) > m.seq:
            return
        ir = _json.decode(b.get("ir", "{}"))
        target, note = scaling.clamp(d.target, int(ir.get("minInstances", 0)), int(ir.get("maxInstances", 0)))
        b.update(desired=str(target), desired_seq=str(m.seq), desired_request=d.request_id,
                 desired_reason=scaling.target_reason(d.source, d.reason, note))

    @on(E.cluster_allocation)
    def on_allocation(self, m: Fact[ev.AllocationRequest]) -> None:
        """Sent only when the gateway's CHOOSE step took (after its ``post_dry_run``): if the fold
        refused that step because a delete request stored before the ``post_dry_run`` had made the
        block ``deleting`` here, the controller handled that delete after the CHOOSE: the block
        keeps the chosen cluster, as in Redis."""
        d = m.data
        b = self._block(d.block_id, d.gen)
        if b is not None and not b.get("cluster") and b.get("status") in _GONE:
            b["cluster"] = d.cluster_id

    @on(E.block_scale_down_chosen)
    def on_scale_down_chosen(self, m: Fact[ev.ScaleDownChosen]) -> None:
        """The instance a scale_down step marked (``scripts.DRAIN_INSTANCE``): removing, by that request."""
        bid, d = m.tokens["bid"], m.data
        inst = self.instances.get(bid, {}).get(d.instance_id)
        if self._block(bid, d.gen) is not None and inst is not None and inst["node"] == d.node_id:
            inst["status"] = "removing"
            inst["drain"] = d.request_id

    @on(E.cluster_reassignment)
    def on_reassignment(self, m: Fact[ev.ReassignRequest]) -> None:
        """The controller's own replacement of a failed/lost instance (request ``{iid}:{why}``)
        counts on the block (``replacements``); operators' and the health monitor's do not."""
        rid, bid = m.data.request_id, m.data.block_id
        if ":" in rid and ":evicted:" not in rid and bid in self.blocks:
            b = self.blocks[bid]
            b["replacements"] = str(int(b.get("replacements", "0")) + 1)

    @on(E.block_ready)
    def on_ready(self, m: Fact[ev.BlockStatusReport]) -> None:
        self._reach(m.tokens["bid"], m.data.gen, lc.BlockStatus.READY)

    @on(E.block_degraded, E.block_restored)
    def on_short(self, m: Fact[cond.BlockShort]) -> None:
        """A ready block's short mark (``schemas.condition``), as its events give it; not digested
        (``recovery.image``): Redis holds the reconciler's latest figures."""
        b = self._block(m.tokens["bid"], m.data.gen)
        if b is None or b.get("status") != _VALUE[lc.BlockStatus.READY]:
            return
        if m.event is E.block_degraded:
            b[cond.FIELD] = cond.encode(m.data)
        else:
            b.pop(cond.FIELD, None)

    @on(E.block_failed)
    def on_failed(self, m: Fact[ev.BlockStatusReport]) -> None:
        self._reach(m.tokens["bid"], m.data.gen, lc.BlockStatus.FAILED, reason=m.data.reason)

    @on(E.block_pending)
    def on_pending(self, m: Fact[pr.Pending]) -> None:
        """Fits nowhere now, or a whole victim of a preemption: waits (``workers.queue``)."""
        d = m.data
        fields = {"reason": d.reason[:2000], "pending_since": f"{d.since:.3f}", "pending_deadline": f"{d.deadline:.3f}"}
        if d.preempted_by:
            fields["preempted_by"] = d.preempted_by
        b = self._block(m.tokens["bid"], d.gen)
        if b is not None and int(b.get("attempt", "0")) > d.attempt:
            self._late_wait(b, fields)
            return
        self._reach(m.tokens["bid"], d.gen, lc.BlockStatus.PENDING, **fields)

    @staticmethod
    def _late_wait(b: dict[str, str], fields: dict[str, str]) -> None:
        """A wait's ``block.pending`` stored after the walker's retry that ended it (its attempt
        is older than the block's: only RETRY takes a pending block to the next one). Redis took
        WAIT then RETRY, whatever the stream's order: the block keeps its status and takes what
        the WAIT wrote and the RETRY left (``pending_since``, ``pending_deadline``, a victim's
        ``preempted_by``), the RETRY's cleared ``reason`` and ``preempting`` unless a later step wrote them."""
        b.update({f: v for f, v in fields.items() if f != "reason"})
        b.setdefault("reason", "")
        b.setdefault("preempting", "")

    @on(E.block_preempting)
    def on_preempting(self, m: Fact[pr.Preempting]) -> None:
        """The waiting preemptor is marked (one preemption at a time) until it is retried."""
        self._step(m.tokens["bid"], m.data.gen, lc.Step.WAIT, preempting=m.data.request_id)

    @on(E.block_delete)
    def on_delete(self, m: Fact[ev.DeleteRequest]) -> None:
        self._step(m.tokens["bid"], None, lc.Step.DELETE)

    @on(E.block_deleted)
    def on_deleted(self, m: Fact[ev.BlockStatusReport]) -> None:
        """The controller took both steps, DELETE then DELETED. Its delete request can sit in the
        stream *before* the block (sent right after the create, stored before the parser's
        ``submitted``): the fold found no block there, the controller, later, did; so a block of
        this generation still live here takes the DELETE step now (else it stays ``parsed`` and
        the gateway's late ``selection`` revives it as ``selecting``, where Redis says deleted)."""
        bid, gen = m.tokens["bid"], m.data.gen
        b = self._block(bid, gen)
        if b is None and gen:  # even its block can come later: the parser wrote Redis, then was
            # slow to store its submitted/parsed (killed, or its server cut off), and the
            # controller deleted the block it found in Redis meanwhile
            self.deleted_ahead.add((bid, int(gen)))
            return
        if b is not None and b.get("status") != _VALUE[lc.BlockStatus.DELETING]:
            self._step(bid, gen, lc.Step.DELETE)
        self._reach(bid, gen, lc.BlockStatus.DELETED)

    # -- registry ----------------------------------------------------------------------------------
    @on(E.cluster_registered)
    def on_cluster_registered(self, m: Fact[ev.ClusterRegistered]) -> None:
        c = m.data.cluster or {}
        if c.get("id"):
            self.clusters[c["id"]] = dumps({"id": c["id"], "labels": c.get("labels", {})})

    @on(E.component_registered)
    def on_component_registered(self, m: Fact[ev.ComponentRegistered]) -> None:
        if m.data.uri:
            self.components[m.data.uri] = dumps(m.data.component or {})

    @on(E.policy_updated)
    def on_policy_updated(self, m: Fact[ev.PolicyUpdated]) -> None:
        d = m.data
        if not d.name or not d.source:
            return  # an old-style notification without the source: nothing to rebuild from
        self.policy_versions[(d.name, d.version)] = {"source": d.source, "language": d.language}
        head = self.policies.get(d.name)
        if head is None or int(head["version"]) < d.version:
            self.policies[d.name] = {"source": d.source, "language": d.language, "version": str(d.version)}

    @on(E.priority_class_registered)
    def on_priority_class_registered(self, m: Fact[pr.PriorityClassRegistered]) -> None:
        rec = m.data.record
        if rec.get("default"):  # one default: as PriorityStore.put_class
            for name, old in list(self.priority_classes.items()):
                was = msgspec.json.decode(old)
                if was.get("default") and name != m.data.name:
                    self.priority_classes[name] = dumps({**was, "default": False})
        self.priority_classes[m.data.name] = dumps(rec)

    @on(E.priority_class_removed)
    def on_priority_class_removed(self, m: Fact[pr.PriorityClassRemoved]) -> None:
        self.priority_classes.pop(m.data.name, None)

    @on(E.quota_set)
    def on_quota_set(self, m: Fact[pr.QuotaSet]) -> None:
        if m.data.record is None:
            self.quotas.pop(m.data.name, None)
        else:
            self.quotas[m.data.name] = dumps(m.data.record)

    # -- nodes -----------------------------------------------------------------------------------
    @on(E.node_registered)
    def on_node_registered(self, m: Fact[ev.NodeRegistered]) -> None:
        try:
            node = Node.model_validate(m.data.node or {})
        except ValidationError:
            self.anomalies.append(f"seq {m.seq}: node {m.tokens['nid']} registered with an invalid record")
            return
        spec = node.model_dump(mode="json")
        totals = {g.id: g.memory for g in node.gpus}
        cur = self.nodes.get(node.id)
        if cur is None or cur.cluster != node.cluster:
            cur = self.nodes[node.id] = NodeState(node.cluster, dumps(spec), node.cpu, node.memory, node.healthy, totals)
        else:  # capacity replaced, usage kept (Store.put_node)
            cur.spec, cur.cpu, cur.memory, cur.healthy = dumps(spec), node.cpu, node.memory, node.healthy
            cur.gpu_total.update(totals)
        cur.agent = m.data.agent or ""
        self.clusters.setdefault(node.cluster, dumps({"id": node.cluster, "labels": {}}))  # Store.ensure_cluster

    @on(E.node_sidecar_start)
    def on_sidecar_start(self, m: Fact[ev.SidecarCommand]) -> None:
        """Where the block's side-cars run (``handlers/sidecars.py``: recorded with its gang)."""
        b = self._block(m.data.block_id, m.data.gen)
        if b is not None:
            b["sidecar_node"] = m.data.node_id or m.tokens["nid"]

    @on(E.node_health)
    def on_node_health(self, m: Fact[ev.NodeHealth]) -> None:
        node = self.nodes.get(m.tokens["nid"])
        if node is not None:
            node.healthy = m.data.healthy

    @on(E.node_drain)
    def on_node_drain(self, m: Fact[vc.NodeDrain]) -> None:
        node = self.nodes.get(m.tokens["nid"])
        if node is not None and node.cluster == m.data.cluster_id:
            node.drain = m.data.drain

    @on(E.node_removed)
    def on_node_removed(self, m: Fact[vc.NodeRemoved]) -> None:
        """``InventoryAdmin.remove_node``: the node, its index entry and its instance index go."""
        nid = m.tokens["nid"]
        node = self.nodes.get(nid)
        if node is not None and node.cluster == m.data.cluster_id:
            del self.nodes[nid]
            self.node_insts.pop(nid, None)

    @on(E.cluster_removed)
    def on_cluster_removed(self, m: Fact[vc.ClusterRemoved]) -> None:
        """``InventoryAdmin.remove_cluster``: the cluster and every node of it."""
        cid = m.tokens["cid"]
        self.clusters.pop(cid, None)
        for nid in [n for n, st in self.nodes.items() if st.cluster == cid]:
            del self.nodes[nid]
            self.node_insts.pop(nid, None)

    @on(E.node_instance_remove)
    def on_remove_command(self, m: Fact[ev.InstanceCommand]) -> None:
        d = m.data
        if d.reason.startswith("dangling:"):
            return  # a leftover the node reported: the record (if any) is not touched
        inst = self.instances.get(d.block_id, {}).get(d.instance_id)
        if inst is not None:
            inst["status"] = "removing"

    # -- virtual clusters (state.vcluster.VC_COMMIT) ------------------------------------------------
    @on(E.vcluster_changed, E.vcluster_flushed)
    def on_vcluster_changed(self, m: Fact[vc.VClusterChanged]) -> None:
        """The record and the node places after one committed change. Changes of a cluster are
        ordered by its state index (``index``), not by where their events landed in the stream:
        a record or a node takes a change only if it is newer than the last one it took."""
        d, vid = m.data, m.tokens["vid"]
        cid, index = d.cluster_id, d.index
        if not cid:
            return
        cur = self.vclusters.get((cid, vid))
        if cur is None or index > cur[0]:
            self.vclusters[(cid, vid)] = [index, None if d.removed else dumps(d.record)]
        for nid, hop in d.moved.items():
            node = self.nodes.get(nid)
            if node is None or node.cluster != cid:
                self.anomalies.append(f"seq {m.seq}: virtual cluster {vid} moved node {nid}, not a node of {cid}")
                continue
            if len(hop) == 2 and index > node.vc_index:
                node.vc, node.vc_index = str(hop[1]), index

    def repair_divisible(self) -> None:
        """Seed 003's failover step 3: a divisible cluster counts its job clusters' nodes, so a job
        node it does not list (``D = V_job - V_divisible``) is added to it, and as many of its dead
        nodes of the same types, outside its job clusters, are dropped. Both records change in one
        atomic commit here (``state.vcluster``), so this finds nothing unless the stream lost an
        event; what it repairs is reported as an anomaly."""
        recs: dict[tuple[str, str], VClusterDoc] = {
            key: _json.decode(rec) for key, (_, rec) in self.vclusters.items() if rec is not None}
        for (cid, vid), job in recs.items():
            parent = recs.get((cid, job.get("parent") or ""))
            if job.get("kind") != "job" or parent is None:
                continue
            missing = {n: t for n, t in (job.get("nodes") or {}).items() if n not in parent["nodes"]}
            if missing:
                self._repair(cid, vid, parent, missing, recs)

    def _repair(self, cid: str, vid: str, parent: VClusterDoc, missing: dict[str, str],
                recs: dict[tuple[str, str], VClusterDoc]) -> None:
        """Job cluster ``vid``'s nodes ``missing`` from its divisible cluster ``parent``: added,
        each for one dead node of its type that no job cluster holds."""
        in_jobs = {n for (c2, _), r in recs.items() if c2 == cid and r.get("parent") == parent["id"] for n in r["nodes"]}
        for nid, t in sorted(missing.items()):
            parent["nodes"][nid] = t
            dead = sorted(n for n, t2 in parent["nodes"].items() if t2 == t and n not in in_jobs and self._dead(n))
            if dead:
                parent["nodes"].pop(dead[0])
        parent["nodes"] = dict(sorted(parent["nodes"].items()))
        self.vclusters[(cid, parent["id"])][1] = dumps(parent)
        self.anomalies.append(f"virtual cluster {parent['id']} repaired from job cluster {vid}: {sorted(missing)}")

    def _dead(self, nid: str) -> bool:
        node = self.nodes.get(nid)
        return node is not None and not node.healthy

    # -- capacity (RESERVE_GANG / RELEASE) -----------------------------------------------------------
    def _reserve(self, cid: str, iid: str, bid: str, nid: str, gpus: list[str], ir: BlockIR, seq: int) -> None:
        if (cid, iid) in self.reservations:
            return  # a redelivered step reuses its reservation
        node = self.nodes.get(nid)
        if node is None or node.cluster != cid:
            self.anomalies.append(f"seq {seq}: {iid} placed on unknown node {nid} of {cid}")
            return
        needs = ir.get("resources") or {}
        exclusive = not share_of(ir) if ir.get("policies") else True
        cpu, mem = needs.get("cpu", 0), int(needs.get("memory", 0))
        node.cpu_used = (node.cpu_used or 0.0) + float(cpu)
        node.mem_used = (node.mem_used or 0) + mem
        taken: dict[str, int] = {}
        units = 0 if exclusive else share_units(needs)  # RESERVE_GANG's gpu_share
        for g in gpus:
            if units:
                node.gpu_share[g] = node.gpu_share.get(g, 0) + units
            m = node.gpu_total.get(g, 0) if exclusive else int(needs.get("gpuMemory", 0))
            taken[g] = m
            use = node.gpu_use.setdefault(g, [0, 0, 0])
            use[0] += m
            use[1] += 1
            if exclusive:
                use[2] = 1
        self.reservations[(cid, iid)] = {
            "node": nid, "block": bid, "cpu": cpu, "mem": mem, "gpus": taken, "exclusive": 1 if exclusive else 0,
        }
        if units:
            self.reservations[(cid, iid)]["share"] = units
        tenant = qp.tenant_of(ir)
        if tenant is not None:  # what workers.allocate sends the script (policies.quota.with_quota)
            models = {str(g.get("id")): str(g.get("model") or "") for g in node.gpus_spec()}
            got = qp.fields(tenant, qp.instance_usage(ir.get("resources") or {}, list(gpus), models))
            if got:
                self.quota_res[(cid, iid)] = got

    def _release(self, cid: str, nid: str, iid: str) -> None:
        self.quota_res.pop((cid, iid), None)
        res = self.reservations.pop((cid, iid), None)
        node = self.nodes.get(nid)
        if res is None or node is None:
            return
        if res["cpu"]:
            node.cpu_used = (node.cpu_used or 0.0) - float(res["cpu"])
        if res["mem"]:
            node.mem_used = (node.mem_used or 0) - res["mem"]
        for g, m in res["gpus"].items():
            if res.get("share"):
                node.gpu_share[g] = node.gpu_share.get(g, 0) - res["share"]
            use = node.gpu_use.setdefault(g, [0, 0, 0])
            use[0] -= m
            use[1] -= 1
            if res["exclusive"]:
                use[2] = 0

    # -- gathers and the registry ------------------------------------------------------------------
    def _gather(self, bid: str, gen: int, attempt: int) -> Gather:
        g = self.gathers.get((bid, gen, attempt))
        if g is None:  # (not setdefault: that builds the empty gather on every event of the round)
            g = self.gathers[(bid, gen, attempt)] = {"expected": [], "deadline": 0.0, "results": {}, "decided": ""}
        return g

    # -- rendering -------------------------------------------------------------------------------
    def image(self, include_gathers: bool = True) -> Image:
        """The state as Redis keys -> values (str, dict for hashes, set, or dict of zset scores)."""
        img: Image = {}
        self._inventory_image(img)
        self.repair_divisible()
        self._vcluster_image(img)
        self._block_image(img)
        self._registry_image(img)
        if include_gathers:
            img.update(self.gather_image(self.gathers))
        return img

    def _inventory_image(self, img: Image) -> None:
        """Components, clusters, nodes (with their usage) and reservations."""
        for uri, comp in self.components.items():
            img[k.component_key(uri)] = comp
        if self.clusters:
            img[k.CLUSTERS] = dict(self.clusters)
        index: dict[str, str] = {}
        for nid, n in self.nodes.items():
            index[nid] = n.cluster
            img.setdefault(k.cluster_nodes_key(n.cluster), set()).add(nid)
            img[node_key(n.cluster, nid)] = n.hash()
        if index:
            img[k.NODE_INDEX] = index
        for (cid, iid), r in self.reservations.items():
            h = img[res_key(cid, iid)] = {
                "node": r["node"], "block": r["block"], "cpu": _num(r["cpu"]), "mem": str(r["mem"]),
                "gpus": dumps(r["gpus"]), "exclusive": str(r["exclusive"]),
            }
            if r.get("share"):
                h["share"] = str(r["share"])
        usage: dict[str, dict[str, float]] = {}
        for (cid, iid), got in sorted(self.quota_res.items()):
            img.setdefault(k.quota_res_key(cid), {})[iid] = dumps(got)
            row = usage.setdefault(cid, {})
            for f, v in got.items():
                row[f] = row.get(f, 0.0) + v
        for cid, row in usage.items():
            img[k.quota_usage_key(cid)] = {f: repr(v) for f, v in sorted(row.items())}
        for cid in self.clusters:  # the counters' version: rebuilt here, not migrated on first use
            img.setdefault(k.quota_usage_key(cid), {})[qp.VERSION_FIELD] = qp.COUNTERS_VERSION

    def _vcluster_image(self, img: Image) -> None:
        vc_index: dict[str, str] = {}
        for (cid, vid), (_, rec) in sorted(self.vclusters.items()):
            if rec is not None:
                img[k.vc_key(cid, vid)] = rec
                img.setdefault(k.vc_set_key(cid), set()).add(vid)
                vc_index[vid] = cid
        if vc_index:
            img[k.VC_INDEX] = vc_index

    def _block_image(self, img: Image) -> None:
        """Blocks, their order, instances, the affinity index and each node's instances."""
        for bid, b in self.blocks.items():
            img[k.block_key(bid)] = dict(b)
        self._queue_image(img)
        order = ZSet({bid: self.block_order.get(bid, 0.0) for bid in self.blocks})
        if order:
            img[k.BLOCKS] = order
        for bid, insts in self.instances.items():
            if insts:
                img[k.inst_key(bid)] = {iid: dumps(i) for iid, i in insts.items()}
        for svc, entries in self.aff_svc.items():
            if entries:
                img[k.aff_svc_key(svc)] = dict(entries)
        if self.aff_lease:
            img[k.AFF_LEASE] = dict(self.aff_lease)
        for nid, on_node in self.node_insts.items():
            if on_node:
                img[k.node_inst_key(nid)] = dict(on_node)

    def _queue_image(self, img: Image) -> None:
        """The pending queue (``state.queue``, scratch keys the digest leaves out): an index of the
        blocks whose record says pending."""
        rows = []
        for bid, b in self.blocks.items():
            if b.get("status") == "pending":
                ir = _json.decode(b.get("ir", "{}"))
                rows.append((bid, queue.scope_of(ir), int(ir.get("priority") or 0), float(b.get("pending_since") or 0),
                             float(b.get("pending_deadline") or 0)))
        for key, value in queue.image(rows).items():
            img[key] = ZSet(value) if key.startswith(queue.PREFIX + "q:") or key == queue.DUE else value

    def _registry_image(self, img: Image) -> None:
        for name, head in self.policies.items():
            img[k.policy_key(name)] = dict(head)
        for (name, version), rec in self.policy_versions.items():
            img[k.policy_version_key(name, version)] = dict(rec)
        if self.policies:
            img[k.POLICIES] = set(self.policies)
        if self.priority_classes:
            img[k.PRIORITY_CLASSES] = dict(self.priority_classes)
        if self.quotas:
            img[k.QUOTAS] = dict(self.quotas)

    def gather_image(self, which: Iterable[tuple[str, int, int]]) -> Image:
        """These gathers' keys (those with candidates: a round without any has no gather)."""
        img: Image = {}
        for bid, gen, attempt in which:
            gather = self.gathers.get((bid, gen, attempt))
            if gather is None or not gather["expected"]:
                continue
            gh: dict[str, str] = {"expected": dumps(gather["expected"]), "deadline": _num(gather["deadline"])}
            gh.update({f"r:{c}": dumps(r) for c, r in gather["results"].items()})
            if gather["decided"]:
                gh["decided"] = gather["decided"]
            img[k.gather_key(bid, gen, attempt)] = gh
        return img

    def open_gathers(self) -> list[tuple[str, int, int]]:
        """Gathers of blocks still selecting (the only ones worth writing back)."""
        out = []
        for bid, gen, attempt in self.gathers:
            b = self.blocks.get(bid)
            if b and b.get("gen") == str(gen) and b.get("status") == "selecting" and int(b.get("attempt", "0")) == attempt:
                out.append((bid, gen, attempt))
        return out


def fold(messages: Any) -> Fold:
    """Fold an iterable of (subject, body, seq, ts)."""
    f = Fold()
    for subject, raw, seq, ts in messages:
        f.apply(subject, raw, seq, ts)
    return f


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:16]

