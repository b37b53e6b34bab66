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

New event kinds are one entry in ``Fold.rules`` (block tails) or ``Fold.node_rules`` (node tails).
Alongside the state, the fold records ``anomalies``: facts that should never happen (an instance
running on two nodes at once, a placement on a node that does not exist).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
from pydantic import ValidationError

from ..handlers import scaling
from ..handlers.gateway import share_of
from ..policies.affinity import uid
from ..policies.capacity import share_units
from ..schemas import lifecycle as lc
from ..schemas.spec import ID_RE, Node
from ..state import keys as k
from ..state.keys import node_key, res_key
from .image import Image, ZSet

_json = msgspec.json
_enc = msgspec.json.Encoder()

#: a block id can be reused once its block is in one of these (CREATE_BLOCK)
REUSABLE = tuple(sorted(lc.REUSABLE))
#: ``lc.into`` of each status (the table is constant; recomputed per event it was a tenth of the fold)
_into = functools.cache(lc.into)
#: each status's value (``Enum.value`` is a Python-level property: slow once per event)
_VALUE = {s: s.value for s in lc.BlockStatus}


def dumps(v: Any) -> str:
    return _enc.encode(v).decode()


@dataclass
class NodeState:
    cluster: str
    spec: str
    cpu: float
    memory: int
    healthy: bool
    gpu_total: dict[str, int]
    #: who serves the node's commands ("" = the simulated fleet)
    agent: str = ""
    cpu_used: float | None = None
    mem_used: int | None = None
    #: gpu -> [mem, n, x] (None until first touched, as HINCRBY creates fields)
    gpu_use: dict[str, list[int]] = field(default_factory=dict)
    #: GPU -> thousandths of its compute held by sharing instances' ``gpuShare`` (``g:<gpu>:share``)
    gpu_share: dict[str, int] = field(default_factory=dict)
    #: its place (virtual cluster id; "" = the primary) and the cluster index of its last move
    vc: str = ""
    vc_index: int = 0
    #: ``blocks node drain``
    drain: bool = False
    #: (spec, its rack label): a cache of ``rack()``
    _rack: tuple[str, str] | None = field(default=None, repr=False, compare=False)

    def rack(self) -> str:
        """The ``rack`` label of its spec (decoded once per spec, not once per placement)."""
        if self._rack is None or self._rack[0] is not self.spec:
            self._rack = (self.spec, _json.decode(self.spec).get("labels", {}).get("rack", ""))
        return self._rack[1]

    def hash(self) -> dict[str, str]:
        """The node's Redis hash, as ``Store.put_node`` and the capacity scripts leave it."""
        h: dict[str, str] = {"spec": self.spec, "cpu": _num(self.cpu), "memory": str(self.memory), "healthy": "1" if self.healthy else "0"}
        if self.agent:
            h["agent"] = self.agent
        for g, total in self.gpu_total.items():
            h[f"g:{g}:total"] = str(total)
        if self.cpu_used is not None:
            h["cpu_used"] = _num(self.cpu_used)
        if self.mem_used is not None:
            h["mem_used"] = str(self.mem_used)
        for g, (mem, cnt, x) in self.gpu_use.items():
            h[f"g:{g}:mem"], h[f"g:{g}:n"], h[f"g:{g}:x"] = str(mem), str(cnt), str(x)
        for g, units in self.gpu_share.items():
            if units:
                h[f"g:{g}:share"] = str(units)
        if self.vc:
            h["vc"] = self.vc
        if self.drain:
            h["drain"] = "1"
        return h


@dataclass
class Fold:
    #: the event rules, by the subject's tail (set below the class: they name its methods)
    rules: ClassVar[dict[str, Callable[[Fold, str, dict[str, Any], int, float], None]]]
    instance_rules: ClassVar[dict[str, Callable[[Fold, str, dict[str, Any], int, float], None]]]
    node_rules: ClassVar[dict[str, Callable[[Fold, str, dict[str, Any], int, float], None]]]

    components: dict[str, str] = field(default_factory=dict)
    clusters: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    blocks: dict[str, dict[str, str]] = field(default_factory=dict)
    block_order: dict[str, float] = field(default_factory=dict)
    instances: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    reservations: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    aff_svc: dict[str, dict[str, str]] = field(default_factory=dict)
    aff_lease: dict[str, str] = field(default_factory=dict)
    #: node -> {iid: bid} (Store.put_instances: what an agent reconciles against)
    node_insts: dict[str, dict[str, str]] = field(default_factory=dict)
    policies: dict[str, dict[str, str]] = field(default_factory=dict)
    policy_versions: dict[tuple[str, int], dict[str, str]] = field(default_factory=dict)
    #: open gathers: (bid, gen, attempt) -> {expected, deadline, results, decided}
    gathers: dict[tuple[str, int, int], dict[str, Any]] = field(default_factory=dict)
    #: a create's gen (its AIOS_INTAKE sequence, told by its ``submitted``) -> digest of its body
    #: (the parser stores it on the block)
    creates: dict[int, str] = field(default_factory=dict)
    #: (bid, gen, iid) -> nodes where it was reported added and not yet removed
    running_on: dict[tuple[str, int, str], set[str]] = field(default_factory=dict)
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
        """Fold one stored message. Messages the state does not depend on are skipped cheaply."""
        self.events += 1
        if seq > self.last_seq:
            self.last_seq = seq
        parts = subject.split(".", 3)
        if len(parts) < 4 or parts[0] != "aios":
            return
        _, entity, key, tail = parts
        if entity == "block":
            self.last_event[key] = (ts, tail)
            if tail == "submitted":  # a create, as the parser stored it from AIOS_INTAKE
                d = _data(raw)
                if isinstance(d.get("gen"), int):
                    self.creates[d["gen"]] = str(d.get("digest") or "")
                if ID_RE.match(key):
                    self.block_order.setdefault(key, ts)
                return
            if tail == "create":  # a stream of a version before AIOS_INTAKE: the create itself, seq = gen
                self.creates[seq] = _digest(raw)
                self.block_order.setdefault(key, ts)
                return
            rule = self.rules.get(tail) or (self.instance_rules.get(tail.rpartition(".")[2]) if tail.startswith("instance.") else None)
            if rule is not None:
                rule(self, key, _data(raw), seq, ts)
        elif entity == "node":
            node_rule = self.node_rules.get(tail)
            if node_rule is not None:
                node_rule(self, key, _data(raw), seq, ts)
        elif entity == "cluster" and tail == "reassignment":
            self.on_reassignment(key, _data(raw), seq, ts)
        elif entity == "cluster" and tail == "removed":
            self.on_cluster_removed(key, _data(raw), seq, ts)
        elif entity == "cluster" and tail == "registered":
            c = _data(raw).get("cluster") or {}
            if c.get("id"):
                self.clusters[c["id"]] = dumps({"id": c["id"], "labels": c.get("labels", {})})
        elif entity == "component" and tail == "registered":
            d = _data(raw)
            if d.get("uri"):
                self.components[d["uri"]] = dumps(d.get("component") or {})
        elif entity == "policy" and tail == "updated":
            self._policy(_data(raw))
        elif entity == "vcluster" and tail in ("changed", "flushed"):
            self.on_vcluster_changed(key, _data(raw), seq, ts)

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
        return True

    def on_parsed(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        gen, attempt = int(d.get("gen", 0)), int(d.get("attempt", 0))
        if attempt == 0:
            self._create(bid, gen, {"status": "parsed", "ir": dumps(d.get("ir") or {}), "created": str(gen)})
        else:  # back through selection after a failed allocation
            b = self._block(bid, gen)
            if b is not None and b.get("status") == "parsed":
                b["attempt"] = str(attempt)
            else:
                self._step(bid, gen, lc.Step.RESELECT, attempt=str(attempt))

    def on_rejected(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        if not ID_RE.match(bid):  # a create on a subject with no valid id (aios.block._invalid): no block
            return
        reason = dumps(d.get("errors") or [])[:2000]
        self._create(bid, int(d.get("gen", 0)), {"status": "rejected", "reason": reason})

    def on_selection(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        gen, attempt = d.get("gen"), int(d.get("attempt", 0))
        b = self._block(bid, gen)
        if b is None or int(b.get("attempt", "0")) != attempt:
            return
        self._step(bid, gen, lc.Step.SELECT)
        if d.get("candidates"):
            g = self._gather(bid, int(gen or 0), attempt)
            g["expected"] = g["expected"] or list(d["candidates"])
            g["deadline"] = g["deadline"] or float(d.get("deadline") or 0)

    def on_deadline(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        g = self._gather(bid, int(d.get("gen", 0)), int(d.get("attempt", 0)))
        g["deadline"] = g["deadline"] or float(d.get("deadline", 0))

    def on_result(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        g = self._gather(bid, int(d.get("gen", 0)), int(d.get("attempt", 0)))
        g["results"][d.get("cluster_id", "")] = {
            "score": d.get("score", 0.0), "node_info": d.get("node_info") or {}, "error": d.get("error", ""),
            "placeable": d.get("placeable", -1), "shortfall": d.get("shortfall", 0),
        }

    def on_post_dry_run(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        gen, attempt = d.get("gen"), int(d.get("attempt", 0))
        g = self._gather(bid, int(gen or 0), attempt)
        g["decided"] = g["decided"] or "recovered"
        b = self._block(bid, gen)
        if b is None or int(b.get("attempt", "0")) != attempt or not d.get("cluster_id"):
            return
        self._step(bid, gen, lc.Step.CHOOSE, cluster=d["cluster_id"])

    def on_placement(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        gen, cid, action = d.get("gen"), d.get("cluster_id", ""), d.get("action", "")
        b = self._block(bid, gen)
        if b is None:
            self.anomalies.append(f"seq {seq}: placement for {bid} gen {gen}, which has no such block")
            return
        ir = _json.decode(b.get("ir", "{}"))
        if action == "allocation":
            self._step(bid, gen, lc.Step.RESERVE, cluster=cid)
        insts = self.instances.setdefault(bid, {})
        for p in d.get("placements") or []:
            iid, nid, gpus = p["instance_id"], p["node_id"], list(p.get("gpus") or [])
            self._reserve(cid, iid, bid, nid, gpus, ir, seq)
            node = self.nodes.get(nid)
            rack = node.rack() if node else ""
            self.aff_svc.setdefault(uid(bid), {})[iid] = dumps([nid, rack])
            self.aff_lease[uid(iid)] = nid
            insts[iid] = {"node": nid, "gpus": gpus, "cluster": cid, "status": "starting", "action": action,
                          "since": round(ts, 3)}
            self.node_insts.setdefault(nid, {})[iid] = bid

    def on_added(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        """Running, if it is the instance the block wants on that node (else the controller only
        sends a remove, see ``on_remove_command``)."""
        iid, gen, nid = d.get("instance_id", ""), d.get("gen"), d.get("node_id", "")
        where = self.running_on.setdefault((bid, int(gen or 0), iid), set())
        where.add(nid)
        if len(where) > 1:
            self.anomalies.append(f"seq {seq}: instance {iid} of {bid} runs on {sorted(where)} at once")
        b = self._block(bid, gen)
        inst = self.instances.get(bid, {}).get(iid)
        if b is None or inst is None or inst["node"] != nid or inst["status"] == "removing":
            return
        inst["status"] = "running"
        if d.get("endpoint"):
            inst["endpoint"] = d["endpoint"]

    def on_removed(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        """Removed for any reason (stopped, start failed, lost, evicted): release and forget it.
        Idempotent: a second ``removed`` finds nothing to release; a fact about an older
        generation of the block id, or about a copy on another node, changes nothing."""
        iid, gen, nid = d.get("instance_id", ""), d.get("gen"), d.get("node_id", "")
        self.running_on.get((bid, int(gen or 0), iid), set()).discard(nid)
        b = self.blocks.get(bid)
        if b is not None and b.get("gen") != str(gen):
            return
        inst = self.instances.get(bid, {}).get(iid)
        if inst is None or inst["node"] != nid:
            return
        del self.instances[bid][iid]
        self._release(inst["cluster"], inst["node"], iid)
        self.node_insts.get(inst["node"], {}).pop(iid, None)
        svc = self.aff_svc.get(uid(bid))
        if svc is not None:
            svc.pop(iid, None)
        self.aff_lease.pop(uid(iid), None)

    def on_scale_target(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        """The controller's rule (``workers.controller.scale_target``, ``scripts.SET_DESIRED``): a
        live, placed block of that generation takes the clamped count unless it holds a later one."""
        gen = d.get("gen") or None
        b = self._block(bid, gen)
        if b is None or b.get("status") not in lc.LIVE or not b.get("cluster"):
            return
        if int(b.get("desired_seq", "0")) > seq:
            return
        ir = _json.decode(b.get("ir", "{}"))
        target, note = scaling.clamp(int(d.get("target", 0)), int(ir.get("minInstances", 0)), int(ir.get("maxInstances", 0)))
        b.update(desired=str(target), desired_seq=str(seq), desired_request=str(d.get("request_id", "")),
                 desired_reason=scaling.target_reason(str(d.get("source", "cli")), str(d.get("reason", "")), note))

    def on_scale_down_chosen(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        """The instance a scale_down step marked (``scripts.DRAIN_INSTANCE``): removing, by that request."""
        inst = self.instances.get(bid, {}).get(d.get("instance_id", ""))
        b = self._block(bid, d.get("gen"))
        if b is not None and inst is not None and inst["node"] == d.get("node_id"):
            inst["status"] = "removing"
            inst["drain"] = str(d.get("request_id", ""))

    def on_reassignment(self, cid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        """The controller's own replacement of a failed/lost instance (request ``{iid}:{why}``)
        counts on the block (``replacements``); operators' and the health monitor's do not."""
        rid, bid = str(d.get("request_id", "")), d.get("block_id", "")
        if ":" in rid and ":evicted:" not in rid and bid in self.blocks:
            b = self.blocks[bid]
            b["replacements"] = str(int(b.get("replacements", "0")) + 1)

    def on_ready(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        self._reach(bid, d.get("gen"), lc.BlockStatus.READY)

    def on_failed(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        self._reach(bid, d.get("gen"), lc.BlockStatus.FAILED, reason=str(d.get("reason", "")))

    def on_delete(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        self._step(bid, None, lc.Step.DELETE)

    def on_deleted(self, bid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        self._reach(bid, d.get("gen"), lc.BlockStatus.DELETED)

    # -- nodes -----------------------------------------------------------------------------------
    def on_node_registered(self, nid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        try:
            node = Node.model_validate(d.get("node") or {})
        except ValidationError:
            self.anomalies.append(f"seq {seq}: node {nid} registered with an invalid record")
            return
        spec = node.model_dump(mode="json")
        totals = {g.id: g.memory for g in node.gpus}
        cur = self.nodes.get(node.id)
        if cur is None or cur.cluster != node.cluster:
            cur = self.nodes[node.id] = NodeState(node.cluster, dumps(spec), node.cpu, node.memory, node.healthy, totals)
        else:  # capacity replaced, usage kept (Store.put_node)
            cur.spec, cur.cpu, cur.memory, cur.healthy = dumps(spec), node.cpu, node.memory, node.healthy
            cur.gpu_total.update(totals)
        cur.agent = str(d.get("agent") or "")
        self.clusters.setdefault(node.cluster, dumps({"id": node.cluster, "labels": {}}))  # Store.ensure_cluster

    def on_sidecar_start(self, nid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        """Where the block's side-cars run (``handlers/sidecars.py``: recorded with its gang)."""
        b = self._block(str(d.get("block_id", "")), d.get("gen"))
        if b is not None:
            b["sidecar_node"] = str(d.get("node_id") or nid)

    def on_node_health(self, nid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        node = self.nodes.get(nid)
        if node is not None and "healthy" in d:
            node.healthy = bool(d["healthy"])

    def on_node_drain(self, nid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        node = self.nodes.get(nid)
        if node is not None and node.cluster == d.get("cluster_id"):
            node.drain = bool(d.get("drain", True))

    def on_node_removed(self, nid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        """``InventoryAdmin.remove_node``: the node, its index entry and its instance index go."""
        node = self.nodes.get(nid)
        if node is not None and node.cluster == d.get("cluster_id"):
            del self.nodes[nid]
            self.node_insts.pop(nid, None)

    def on_cluster_removed(self, cid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        """``InventoryAdmin.remove_cluster``: the cluster and every node of it."""
        self.clusters.pop(cid, None)
        for nid in [n for n, st in self.nodes.items() if st.cluster == cid]:
            del self.nodes[nid]
            self.node_insts.pop(nid, None)

    def on_remove_command(self, nid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        if str(d.get("reason", "")).startswith("dangling:"):
            return  # a leftover the node reported: the record (if any) is not touched
        inst = self.instances.get(d.get("block_id", ""), {}).get(d.get("instance_id", ""))
        if inst is not None:
            inst["status"] = "removing"

    # -- virtual clusters (state.vcluster.VC_COMMIT) ------------------------------------------------
    def on_vcluster_changed(self, vid: str, d: dict[str, Any], seq: int, ts: float) -> None:
        """The record and the node places after one committed change. Changes of a cluster are
        ordered by its state index (``index``), not by where their events landed in the stream:
        a record or a node takes a change only if it is newer than the last one it took."""
        cid, index, rec = str(d.get("cluster_id", "")), int(d.get("index") or 0), d.get("record")
        if not cid or not isinstance(rec, dict):
            return
        cur = self.vclusters.get((cid, vid))
        if cur is None or index > cur[0]:
            self.vclusters[(cid, vid)] = [index, None if d.get("removed") else dumps(rec)]
        for nid, hop in (d.get("moved") or {}).items():
            node = self.nodes.get(nid)
            if node is None or node.cluster != cid:
                self.anomalies.append(f"seq {seq}: virtual cluster {vid} moved node {nid}, not a node of {cid}")
                continue
            if isinstance(hop, list) and len(hop) == 2 and index > node.vc_index:
                node.vc, node.vc_index = str(hop[1]), index

    def repair_divisible(self) -> None:
        """Seed 003's failover step 3: a divisible cluster counts its job clusters' nodes, so a job
        node it does not list (``D = V_job - V_divisible``) is added to it, and as many of its dead
        nodes of the same types, outside its job clusters, are dropped. Both records change in one
        atomic commit here (``state.vcluster``), so this finds nothing unless the stream lost an
        event; what it repairs is reported as an anomaly."""
        recs = {key: _json.decode(rec) for key, (_, rec) in self.vclusters.items() if rec is not None}
        for (cid, vid), job in recs.items():
            parent = recs.get((cid, job.get("parent") or ""))
            if job.get("kind") != "job" or parent is None:
                continue
            missing = {n: t for n, t in (job.get("nodes") or {}).items() if n not in parent["nodes"]}
            if not missing:
                continue
            in_jobs = {n for (c2, _), r in recs.items() if c2 == cid and r.get("parent") == parent["id"] for n in r["nodes"]}
            for nid, t in sorted(missing.items()):
                parent["nodes"][nid] = t
                dead = sorted(n for n, t2 in parent["nodes"].items() if t2 == t and n not in in_jobs and n in self.nodes
                              and not self.nodes[n].healthy)
                if dead:
                    parent["nodes"].pop(dead[0])
            parent["nodes"] = dict(sorted(parent["nodes"].items()))
            self.vclusters[(cid, parent["id"])][1] = dumps(parent)
            self.anomalies.append(f"virtual cluster {parent['id']} repaired from job cluster {vid}: {sorted(missing)}")

    # -- capacity (RESERVE_GANG / RELEASE) -----------------------------------------------------------
    def _reserve(self, cid: str, iid: str, bid: str, nid: str, gpus: list[str], ir: dict[str, Any], seq: int) -> None:
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

    def _release(self, cid: str, nid: str, iid: str) -> None:
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
    def _gather(self, bid: str, gen: int, attempt: int) -> dict[str, Any]:
        g = self.gathers.get((bid, gen, attempt))
        if g is None:  # (not setdefault: that builds the empty gather on every event of the round)
            g = self.gathers[(bid, gen, attempt)] = {"expected": [], "deadline": 0.0, "results": {}, "decided": ""}
        return g

    def _policy(self, d: dict[str, Any]) -> None:
        name, version = d.get("name"), d.get("version")
        if not name or not isinstance(version, int) or "source" not in d:
            return  # an old-style notification without the source: nothing to rebuild from
        language = str(d.get("language", "python"))
        self.policy_versions[(name, version)] = {"source": d["source"], "language": language}
        head = self.policies.get(name)
        if head is None or int(head["version"]) < version:
            self.policies[name] = {"source": d["source"], "language": language, "version": str(version)}

    # -- rendering -------------------------------------------------------------------------------
    def image(self, include_gathers: bool = True) -> Image:
        """The state as Redis keys -> values (str, dict for hashes, set, or dict of zset scores)."""
        img: Image = {}
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
            img[res_key(cid, iid)] = {
                "node": r["node"], "block": r["block"], "cpu": _num(r["cpu"]), "mem": str(r["mem"]),
                "gpus": dumps(r["gpus"]), "exclusive": str(r["exclusive"]),
            }
            if r.get("share"):
                img[res_key(cid, iid)]["share"] = str(r["share"])
        self.repair_divisible()
        vc_index: dict[str, str] = {}
        for (cid, vid), (_, rec) in sorted(self.vclusters.items()):
            if rec is not None:
                img[k.vc_key(cid, vid)] = rec
                img.setdefault(k.vc_set_key(cid), set()).add(vid)
                vc_index[vid] = cid
        if vc_index:
            img[k.VC_INDEX] = vc_index
        for bid, b in self.blocks.items():
            img[k.block_key(bid)] = dict(b)
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
        for name, head in self.policies.items():
            img[k.policy_key(name)] = dict(head)
        for (name, version), rec in self.policy_versions.items():
            img[k.policy_version_key(name, version)] = dict(rec)
        if self.policies:
            img[k.POLICIES] = set(self.policies)
        if include_gathers:
            img.update(self.gather_image(self.gathers))
        return img

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


Rule = Callable[[Fold, str, dict[str, Any], int, float], None]

Fold.rules = {
    "parsed": Fold.on_parsed,
    "rejected": Fold.on_rejected,
    "selection": Fold.on_selection,
    "dry_run.deadline": Fold.on_deadline,
    "dry_run.result": Fold.on_result,
    "post_dry_run": Fold.on_post_dry_run,
    "placement": Fold.on_placement,
    "scale.target": Fold.on_scale_target,
    "scale_down.chosen": Fold.on_scale_down_chosen,
    "ready": Fold.on_ready,
    "failed": Fold.on_failed,
    "delete": Fold.on_delete,
    "deleted": Fold.on_deleted,
}
#: ``aios.block.{bid}.instance.{iid}.<tail>``
Fold.instance_rules = {
    "added": Fold.on_added,
    "removed": Fold.on_removed,
}
#: ``aios.node.{nid}.<tail>``
Fold.node_rules = {
    "registered": Fold.on_node_registered,
    "health": Fold.on_node_health,
    "instance.remove": Fold.on_remove_command,
    "drain": Fold.on_node_drain,
    "removed": Fold.on_node_removed,
    "sidecar.start": Fold.on_sidecar_start,
}


def fold(messages: Any) -> Fold:
    """Fold an iterable of (subject, body, seq, ts)."""
    f = Fold()
    for subject, raw, seq, ts in messages:
        f.apply(subject, raw, seq, ts)
    return f


class _Envelope(msgspec.Struct):
    """The one envelope field the fold reads; the decoder skips the others without building them."""

    data: Any = None


_envelope = msgspec.json.Decoder(_Envelope)


def _data(raw: bytes) -> dict[str, Any]:
    try:
        data = _envelope.decode(raw).data
    except msgspec.DecodeError:  # not JSON, or not an object (ValidationError is a DecodeError)
        return {}
    return data if isinstance(data, dict) else {}


def _digest(raw: bytes) -> str:
    import hashlib

    return hashlib.sha256(raw).hexdigest()[:16]


def _num(v: float | int) -> str:
    """A number as Redis prints it back: integers without a decimal point."""
    f = float(v)
    return str(int(f)) if f.is_integer() else repr(f)
