"""Policy inputs rebuilt by replay: what ``blocks explain`` and ``blocks policy test`` show and
re-run, now that the stream stores no input (``schemas.events.Decision``).

A decision record names the state version its step read (``at``: the stream sequence of the
message the step handled), the digest of its input and the input parts that are not state
(``given``: the collector's ``block_metrics``). The input is everything else: the IR, the clusters,
the nodes' capacity and usage, the affinity index, the block's instances, the gather's answers,
all of which the stream's facts determine. So the stream is folded (``recovery.fold``, the code
``blocks recover`` uses) and, at the recorded version, the step's own payload code runs again
(``handlers.gateway.select`` / ``choose``, ``handlers.controller.dry_run`` / ``plan``) with an
``invoke`` that captures each input and answers with the recorded output, so a step of several
calls (a gang's allocation, where each call sees the choices before it) is rebuilt call by call.

A step reads Redis, which runs slightly ahead of the stream (a reservation is taken before its
placement is published; hints reach a cache a little later), so the state it saw is the fold
at ``at`` or at one of the next state changes: each is tried in order, from ``at`` to a little
past the step's own event, and the first whose rebuilt inputs all have the recorded digests is
the one. A plan that matches none is tried once more with the reservations of earlier requests
stored after it taken (``Placed``: a controller's batches are stored in the order they finish,
not the order its plans reserved in). A step whose inputs match no state is reported
``mismatch`` (never shown as its input).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from bisect import bisect_right
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, cast

import msgspec

from ..handlers import controller as hc
from ..handlers import gateway as hg
from ..policies import affinity
from ..policies.capacity import Nodes
from ..projections.base import parse
from ..schemas.catalog import ROOT, E
from ..schemas.errors import PlacementFailed, PolicyFailed
from ..schemas.events import input_matches
from ..schemas.records import (
    JSON,
    BlockIR,
    BlockRecord,
    ClusterRecord,
    DecisionGiven,
    DecisionRecord,
    GatherRecord,
    InstanceRecord,
    JSONObject,
    NodeView,
)
from ..state.store import node_view
from .fold import Fold

_json = msgspec.json
#: the subjects of a block's events start with this
_BLOCK = f"{ROOT}.block."

#: how many messages past a step's own event its state may still lie (a reservation taken before
#: the step read Redis, published after the step's event)
SLACK = 256

#: events after which the state a step reads may differ (the others change nothing it reads)
STATE_EVENTS = frozenset({
    "block.parsed", "block.selection", "block.dry_run.result", "block.post_dry_run", "block.placement",
    "block.instance.added", "block.instance.removed", "block.ready", "block.failed", "block.deleted", "block.delete",
    "node.registered", "node.health", "node.instance.remove", "node.drain", "node.removed", "cluster.registered",
    "cluster.removed", "cluster.reassignment", "vcluster.changed", "vcluster.flushed",
})

#: step events whose decisions are resourceAllocator plans (``handlers.controller.plan``)
PLAN_STEPS = frozenset({"block.placement", "block.allocation.failed", "block.scale.failed", "block.reassignment.failed",
                        "block.decision"})
#: the command a plan step handled -> its action
PLAN_TRIGGERS = {"cluster.allocation": "allocation", "cluster.scale": "scale", "cluster.reassignment": "reassignment"}


@dataclass
class Call:
    """One recorded decision and, once rebuilt, its input."""

    decision: DecisionRecord
    step_subject: str
    step_seq: int
    index: int
    #: ``rebuilt`` (digest matched), ``recorded`` (an old record that holds its input), ``mismatch``,
    #: ``unsupported`` (a step kind this module does not rebuild)
    status: str = "mismatch"
    input: Any = None
    #: the stream sequence whose state gave the input
    state_seq: int = 0


@dataclass
class Step:
    subject: str
    seq: int
    event: str
    #: the step event's data (open JSON: each step event has its own payload)
    data: JSONObject
    calls: list[Call]
    #: when the stream stored it (seconds)
    ts: float = 0.0
    #: the message it handled (``at``), when recorded
    trigger: tuple[str, JSONObject] | None = None
    lo: int = 0
    hi: int = 0
    #: calls before this one are rebuilt (a plan's attempts are rebuilt one after another)
    cursor: int = 0
    #: ``State.key`` when it last tried
    tried: tuple[Any, ...] | None = None

    @property
    def done(self) -> bool:
        return self.cursor >= len(self.calls)


class _Mismatch(Exception):
    pass


class State:
    """Reads of a fold, shaped as the workers read Redis (``Store``, ``Inventory``). One for the
    whole replay: like a worker's inventory, each cluster's node views are one ``Nodes`` dict
    whose changed nodes are replaced (``note`` says which a message touches), so the capacity
    memos catch up in O(changes), and ``key`` tells a step whether what it reads changed since
    it last tried."""

    def __init__(self, fold: Fold):
        self.f = fold
        self._views: dict[str, tuple[dict[str, str], NodeView]] = {}
        self._nodes: dict[str, Nodes] = {}
        #: cluster -> nodes to re-read (None: the whole cluster)
        self._dirty: dict[str, set[str] | None] = {}
        #: cluster -> how many times its dict was made anew; block -> its events so far
        self._gen: dict[str, int] = {}
        self._block_events: dict[str, int] = {}
        self._clusters_gen = 0

    def note(self, subject: str, data: JSONObject) -> None:
        """Before the fold applies a message: mark what it may change."""
        parts = subject.split(".")
        if len(parts) < 4:
            return
        entity, key = parts[1], parts[2]
        bid = key if entity == "block" else str(data.get("block_id", ""))
        if bid:  # its record or instances (a remove command marks an instance removing)
            self._block_events[bid] = self._block_events.get(bid, 0) + 1
        if entity == "block":
            nid = str(data.get("node_id", ""))
            if nid:
                self._touch_node(nid)
            placements = data.get("placements")
            for p in placements if isinstance(placements, list) else []:
                if isinstance(p, dict):
                    self._touch(str(data.get("cluster_id", "")), str(p.get("node_id", "")))
        elif entity == "node":
            if parts[3] == "registered":
                node = data.get("node")
                cid = str(node.get("cluster", "")) if isinstance(node, dict) else ""
                self._dirty[cid] = None
                self._clusters_gen += 1
            self._touch_node(key)
        elif entity in ("cluster", "vcluster"):
            cid = key if entity == "cluster" else str(data.get("cluster_id", ""))
            if parts[3] in ("registered", "removed", "changed", "flushed"):
                self._dirty[cid] = None
                self._clusters_gen += 1

    def _touch_node(self, nid: str) -> None:
        node = self.f.nodes.get(nid)
        if node is not None:
            self._touch(node.cluster, nid)

    def _touch(self, cid: str, nid: str) -> None:
        cur = self._dirty.get(cid, set())
        if cur is not None:
            cur.add(nid)
            self._dirty[cid] = cur

    def clusters(self) -> dict[str, ClusterRecord]:
        return {cid: _json.decode(v) for cid, v in self.f.clusters.items()}

    @contextlib.contextmanager
    def taken(self, cid: str, placements: list[_Placement]) -> Iterator[None]:
        """The fold with ``placements``' reservations taken (``Fold._reserve``) while inside, its
        nodes and reservation records as they were after."""
        f = self.f
        nids = {nid for p in placements for _iid, nid, _g in p.parts if nid in f.nodes}
        nodes = {nid: copy.deepcopy(f.nodes[nid]) for nid in nids}
        added: list[tuple[str, str]] = []
        anomalies = len(f.anomalies)
        try:
            for p in placements:
                b = f.blocks.get(p.block)
                if b is None or int(b.get("gen", "0")) != p.gen:
                    continue
                ir = _json.decode(b.get("ir", "{}"))
                for iid, nid, gpus in p.parts:
                    if (cid, iid) not in f.reservations:
                        added.append((cid, iid))
                        f._reserve(cid, iid, p.block, nid, list(gpus), ir, p.seq)
            for nid in nids:
                self._touch(cid, nid)
            yield
        finally:
            f.nodes.update(nodes)
            for key in added:
                f.reservations.pop(key, None)
                f.quota_res.pop(key, None)
            del f.anomalies[anomalies:]
            for nid in nids:
                self._touch(cid, nid)

    def _view(self, nid: str) -> NodeView:
        h = self.f.nodes[nid].hash()
        cached = self._views.get(nid)
        if cached is None or cached[0] != h:
            cached = self._views[nid] = (h, node_view(h))
        return cached[1]

    def nodes(self, cid: str) -> dict[str, NodeView]:
        """The cluster's node views, by node id in order (``Store.node_ids``, ``Inventory``)."""
        dirty = self._dirty.pop(cid, set())
        out = self._nodes.get(cid)
        if out is None or dirty is None:
            out = self._nodes[cid] = Nodes()
            self._gen[cid] = self._gen.get(cid, 0) + 1
            for nid in sorted(n for n, st in self.f.nodes.items() if st.cluster == cid):
                out[nid] = self._view(nid)
            return out
        for nid in sorted(dirty):
            node = self.f.nodes.get(nid)
            if node is None or node.cluster != cid or nid not in out:
                if nid in out or (node is not None and node.cluster == cid):
                    self._dirty[cid] = None  # a node gone or new: the dict is made anew (order)
                    return self.nodes(cid)
                continue
            view = self._view(nid)
            if out[nid] is not view:
                out[nid] = view
        return out

    def all_nodes(self) -> dict[str, dict[str, NodeView]]:
        return {cid: self.nodes(cid) for cid in self.clusters()}

    def key(self, step: Step) -> tuple[Any, ...]:
        """What the step's inputs are made of, changed or not since it last tried."""
        bid = str(step.data.get("block_id") or step.subject.split(".")[2])
        if step.event in ("block.selection", "block.post_dry_run"):
            cids = sorted(self.f.clusters)
        elif step.event == "block.dry_run.result":  # its trigger is the round's parsed event: no cluster
            cids = [str(step.data.get("cluster_id", ""))]
        else:
            cids = [str((step.trigger[1] if step.trigger else step.data).get("cluster_id", ""))]
        versions = []
        for cid in cids:
            nodes = self.nodes(cid)
            versions.append((cid, self._gen.get(cid, 0), getattr(nodes, "version", 0)))
        return (self._clusters_gen, tuple(versions), self._block_events.get(bid, 0), step.cursor)

    def index(self, ir: BlockIR) -> affinity.Index:
        """``state.inventory.affinity_index`` over the fold."""
        svcs, leases = affinity.referenced(ir.get("affinity") or [])
        if not svcs and not leases:
            return affinity.empty_index()
        services = {svc: sorted(_json.decode(v) for v in self.f.aff_svc.get(svc, {}).values()) for svc in svcs}
        return {"services": services, "leases": {k: self.f.aff_lease[k] for k in leases if self.f.aff_lease.get(k)}}

    def block(self, bid: str) -> BlockRecord | None:
        b = self.f.blocks.get(bid)
        if b is None:
            return None
        return {"gen": int(b.get("gen", "0")), "ir": _json.decode(b.get("ir", "{}")), "status": b.get("status", "")}

    def instances(self, bid: str) -> dict[str, InstanceRecord]:
        return {iid: _json.decode(_json.encode(i)) for iid, i in self.f.instances.get(bid, {}).items()}

    def gather(self, bid: str, gen: int, attempt: int) -> GatherRecord:
        g = self.f.gathers.get((bid, gen, attempt))
        expected, results = (g["expected"], g["results"]) if g is not None else ([], {})
        return _json.decode(_json.encode({"expected": expected, "results": results}))


Invoke = hc.Invoke


def _scripted(calls: list[Call]) -> tuple[Invoke, list[bytes]]:
    """An ``invoke`` that records each input (encoded at once: the caller goes on changing its
    working copy) and answers with the recorded output, or raises the recorded failure."""
    captured: list[bytes] = []

    async def invoke(input_data: Mapping[str, object]) -> Any:
        i = len(captured)
        captured.append(_json.encode(input_data))
        if i >= len(calls):
            raise _Mismatch(f"more calls than recorded ({i + 1})")
        d = calls[i].decision
        if d.get("error"):
            raise PolicyFailed(str(d.get("policy", "?")), str(d.get("action", "?")), str(d["error"]))
        return d.get("output")

    return invoke, captured


async def _run(step: Step, st: State) -> list[bytes] | None:
    """Run the step's payload code on ``st``, answering with the recorded outputs from the step's
    cursor on; the inputs it built, or None when this step cannot be rebuilt on this state."""
    bid = str(step.data.get("block_id") or step.subject.split(".")[2])
    block = st.block(bid)
    run = _RUNS.get(step.event) or (_run_plan if step.event in PLAN_STEPS else None)
    if block is None or run is None:
        return None
    invoke, captured = _scripted(step.calls[step.cursor:])
    try:
        if not await run(step, st, bid, block["ir"], invoke):
            return None
    except _Mismatch:
        return None
    return captured


async def _run_selection(step: Step, st: State, bid: str, ir: BlockIR, invoke: Invoke) -> bool:
    await hg.select(ir, st.clusters(), st.all_nodes(), invoke, st.index(ir))
    return True


async def _run_post_dry_run(step: Step, st: State, bid: str, ir: BlockIR, invoke: Invoke) -> bool:
    data = step.data
    g = st.gather(bid, _int(data.get("gen", 0)), _int(data.get("attempt", 0)))
    if isinstance(answers := data.get("answers"), list):  # the answers it decided on travel with it
        g["results"] = {str(a.get("cluster_id", "")): a for a in answers if isinstance(a, dict)}
    clusters = st.clusters()
    entries = {cid: hg.scoped_entry(ir, clusters[cid], st.nodes(cid), st.index(ir)) for cid in g["expected"] if cid in clusters}
    await hg.choose(g["expected"], g["results"], entries, invoke, int(ir.get("minInstances") or 1))
    return True


def _int(v: JSON) -> int:
    """A count an event's data holds (``gen``, ``attempt``)."""
    return int(v) if isinstance(v, int | float | str) else 0


async def _run_dry_run(step: Step, st: State, bid: str, ir: BlockIR, invoke: Invoke) -> bool:
    cid = str(step.data.get("cluster_id", ""))
    cluster = st.clusters().get(cid, {"id": cid, "labels": {}})
    await hc.dry_run(ir, cluster, st.nodes(cid), invoke, st.index(ir))
    return True


async def _run_plan(step: Step, st: State, bid: str, ir: BlockIR, invoke: Invoke) -> bool:
    """A resourceAllocator plan, for the command (allocation, scale, reassignment) the step handled."""
    if step.trigger is None or step.trigger[0] not in PLAN_TRIGGERS:
        return False
    tname, tdata = step.trigger
    action = PLAN_TRIGGERS[tname]
    given: DecisionGiven = step.calls[step.cursor].decision.get("given") or {}
    cid = str(tdata.get("cluster_id", ""))
    extra: PlanExtras = {}
    instances: dict[str, InstanceRecord] | None = None
    if action == "allocation":
        iids = [hc.instance_id(bid, i) for i in range(int(ir.get("minInstances") or 0))]
    else:
        iids = [hc.instance_id(bid, str(tdata.get("request_id", "")))]
        instances = st.instances(bid)
        extra["block_metrics"] = given.get("block_metrics", {})
        if action == "reassignment":
            extra["instance_id"] = extra["pod_name"] = str(tdata.get("instance_id", ""))
            extra["reason"] = str(tdata.get("reason", "requested"))
    if given.get("excluded_nodes"):  # suspect / avoided nodes, as the step left them out
        extra["excluded_nodes"] = given["excluded_nodes"]
    cluster = st.clusters().get(cid, {"id": cid, "labels": {}})
    try:
        await hc.plan(ir, cluster, st.nodes(cid), action, iids, invoke, instances, st.index(ir), **extra)
    except PlacementFailed:
        pass
    return True


class PlanExtras(TypedDict, total=False):
    """What ``handlers.controller.plan`` is given besides the snapshot, as the step's command and
    its decision's ``given`` say (its ``**extra``)."""

    block_metrics: JSONObject
    instance_id: str
    pod_name: str
    reason: str
    excluded_nodes: dict[str, str]


#: the steps rebuilt by running their code again, by event (plans: ``PLAN_STEPS``)
_RUNS: dict[str, Callable[[Step, State, str, BlockIR, Invoke], Awaitable[bool]]] = {
    "block.selection": _run_selection, "block.post_dry_run": _run_post_dry_run, "block.dry_run.result": _run_dry_run,
}


async def _try(step: Step, st: State, seq: int, placed: Placed | None = None) -> None:
    """Rebuild what this state can: the calls of one run of the step's code (a plan attempt, or
    the one call of the other steps), then the next attempt's on the same state, and so on. A
    plan that matches no state as stored is tried once more on the state with the reservations
    taken ahead of it (``Placed.ahead``)."""
    while not step.done:
        captured = await _run(step, st)
        if not captured:
            return
        todo = step.calls[step.cursor:step.cursor + len(captured)]
        if not _all_match(captured, todo) and placed is not None and step.event in PLAN_STEPS:
            captured = await _run_ahead(step, st, seq, placed)
            todo = step.calls[step.cursor:step.cursor + len(captured or [])]
        if not captured or not _all_match(captured, todo):
            return
        for raw, c in zip(captured, todo, strict=True):
            c.status, c.input, c.state_seq = "rebuilt", _json.decode(raw), seq
        step.cursor += len(captured)
        while not step.done and step.calls[step.cursor].status == "recorded":
            step.cursor += 1


def _strs(v: JSON) -> tuple[str, ...]:
    return tuple(str(x) for x in v) if isinstance(v, list) else ()


def _all_match(captured: list[bytes], todo: list[Call]) -> bool:
    return len(todo) == len(captured) and all(
        input_matches(raw, c.decision.get("input_digest")) for raw, c in zip(captured, todo, strict=True))


@dataclass(frozen=True)
class _Placement:
    """A stored ``placement`` with the trigger sequence its plan recorded (``Decision.at``)."""

    seq: int
    at: int
    block: str
    gen: int
    cluster: str
    #: (instance, node, GPUs) of each placement
    parts: tuple[tuple[str, str, tuple[str, ...]], ...]


class Placed:
    """The stream's planned placements, for the reservations a plan's view held before their
    events were stored.

    One controller plans a cluster's requests one at a time in the order it took them (its
    cluster lock) and its view takes each reservation at once, but it stores them with its
    batches: a later request handled alone may be stored before an earlier batch's. A plan's view
    then holds reservations stored after the state it would otherwise match: those of the
    requests taken before its own. ``ahead`` names them (same cluster, planned on an earlier
    trigger, stored after ``seq`` and within the step's slack)."""

    def __init__(self, messages: list[tuple[str, bytes, int, float]]):
        self.items: list[_Placement] = []
        #: cluster -> its placements' stream sequences and the placements, in stream order
        self._by_cluster: dict[str, tuple[list[int], list[_Placement]]] = {}
        for subject, raw, seq, _ts in messages:
            if _event_name(subject) != "block.placement" or b'"decisions"' not in raw:
                continue
            data = _data(raw)
            ats = [int(d.get("at") or 0) for d in decisions_of(subject, data)]
            at = min((a for a in ats if a), default=0)
            found = data.get("placements")
            if not at or not isinstance(found, list):
                continue
            parts = tuple((str(p.get("instance_id", "")), str(p.get("node_id", "")), _strs(p.get("gpus")))
                          for p in found if isinstance(p, dict))
            item = _Placement(seq, at, subject.split(".")[2], _int(data.get("gen", 0)), str(data.get("cluster_id", "")), parts)
            self.items.append(item)
            seqs, items = self._by_cluster.setdefault(item.cluster, ([], []))
            seqs.append(seq)
            items.append(item)

    def ahead(self, step: Step, seq: int, cid: str) -> list[_Placement]:
        """The cluster's placements stored after ``seq`` (up to the step's slack) whose plans
        were triggered before the step's, other blocks' (a search in the cluster's window)."""
        bid = str(step.data.get("block_id") or step.subject.split(".")[2])
        at = min((int(c.decision.get("at") or 0) for c in step.calls), default=0)
        seqs, items = self._by_cluster.get(cid, ([], []))
        window = items[bisect_right(seqs, seq):bisect_right(seqs, step.hi)]
        return [p for p in window if p.at < at and p.block != bid]


async def _run_ahead(step: Step, st: State, seq: int, placed: Placed) -> list[bytes] | None:
    """The step's code run on the state at ``seq`` with ``Placed.ahead``'s reservations taken as
    the fold takes them (then put back as they were)."""
    if step.trigger is None:
        return None
    cid = str(step.trigger[1].get("cluster_id", ""))
    ahead = placed.ahead(step, seq, cid)
    if not ahead:
        return None
    with st.taken(cid, ahead):
        return await _run(step, st)


def _event_name(subject: str) -> str:
    hit = parse(subject)
    return hit[0].name if hit else ""


def _data(raw: bytes) -> JSONObject:
    try:
        env = _json.decode(raw)
    except msgspec.DecodeError:
        return {}
    d = env.get("data") if isinstance(env, dict) else None
    return d if isinstance(d, dict) else {}


def _is_decision(subject: str) -> bool:
    found = parse(subject)
    return found is not None and found[0] is E.block_decision


def decisions_of(subject: str, data: JSONObject) -> list[DecisionRecord]:
    """The decisions a stored event records (a step event's ``decisions``, or a ``decision``)."""
    if _is_decision(subject):
        return [_decision(data)] if data else []
    found = data.get("decisions")
    return [_decision(d) for d in found if isinstance(d, dict)] if isinstance(found, list) else []


def _decision(d: JSONObject) -> DecisionRecord:
    """A stored decision (``schemas.events.Decision`` as JSON), typed: the same object (a record
    of an older version may hold fields no longer named; they are kept, unread)."""
    return cast(DecisionRecord, d)


def _parts(name: str, data: JSONObject) -> list[tuple[str, JSONObject]]:
    """The steps one stored event records: itself, and for a ``post_dry_run`` first each dry_run
    answer it carries (answers travel over core NATS; their decisions are stored with the round's
    decision, each rebuilt as the dry_run step it was)."""
    out: list[tuple[str, JSONObject]] = []
    if name == "block.post_dry_run" and isinstance(answers := data.get("answers"), list):
        out += [("block.dry_run.result", a) for a in answers if isinstance(a, dict)]
    out.append((name, data))
    return out


def _step(subject: str, seq: int, name: str, data: JSONObject, recorded: list[DecisionRecord], ts: float, prev: int,
          by_seq: dict[int, tuple[str, bytes]]) -> Step:
    step = Step(subject, seq, name, data, [Call(d, subject, seq, i) for i, d in enumerate(recorded)], ts)
    for c in step.calls:
        if c.decision.get("input") is not None:  # an older record that holds its input
            c.status, c.input = "recorded", c.decision["input"]
    ats = [int(c.decision.get("at") or 0) for c in step.calls]
    at = min((a for a in ats if a), default=0)
    if at and at in by_seq:
        tsub, traw = by_seq[at]
        step.trigger = (_event_name(tsub), _data(traw))
    step.lo = at or prev
    step.hi = seq + SLACK
    while not step.done and step.calls[step.cursor].status == "recorded":
        step.cursor += 1
    return step


async def rebuild(
    messages: list[tuple[str, bytes, int, float]], block_id: str | None = None
) -> list[Step]:
    """Every step with decisions in ``messages`` (stream order; those of ``block_id`` only, when
    given), each call's input rebuilt by replay (``Call.status``, ``Call.input``)."""
    steps = _steps(messages, block_id)
    pending = sorted((s for s in steps if not s.done), key=lambda s: s.lo)
    if pending:
        await _replay(messages, pending)
    for step in steps:
        plan_of_unknown = step.event in PLAN_STEPS and (step.trigger is None or step.trigger[0] not in PLAN_TRIGGERS)
        if plan_of_unknown or step.event not in PLAN_STEPS | set(_RUNS):
            for c in step.calls:
                if c.status == "mismatch":
                    c.status = "unsupported"
    return steps


def _steps(messages: list[tuple[str, bytes, int, float]], block_id: str | None) -> list[Step]:
    """The steps with decisions, in stream order (a block's first one replays from its previous event)."""
    steps: list[Step] = []
    last_of_block: dict[str, int] = {}
    by_seq: dict[int, tuple[str, bytes]] = {}
    for subject, raw, seq, ts in messages:
        by_seq[seq] = (subject, raw)
        found = parse(subject)
        bid = found[1].get("bid") if found is not None and found[0].pattern.startswith(_BLOCK) else None
        if bid is None:
            continue
        prev = last_of_block.get(bid, 0)
        last_of_block[bid] = seq
        if block_id is not None and bid != block_id:
            continue
        if found is None or not (found[0] is E.block_decision or b'"decisions"' in raw):
            continue
        for part_name, part in _parts(found[0].name, _data(raw)):
            recorded = decisions_of(subject, part)
            if recorded:
                steps.append(_step(subject, seq, part_name, part, recorded, ts, prev, by_seq))
    return steps


async def _replay(messages: list[tuple[str, bytes, int, float]], pending: list[Step]) -> None:
    """Fold the stream; at each state a pending step may have read, try to rebuild its inputs."""
    fold = Fold()
    st = State(fold)
    placed = Placed(messages)
    active: list[Step] = []
    nxt = 0
    for subject, raw, seq, ts in messages:
        changed = _event_name(subject) in STATE_EVENTS
        if changed:
            st.note(subject, _data(raw))
        fold.apply(subject, raw, seq, ts)
        while nxt < len(pending) and pending[nxt].lo <= seq:
            active.append(pending[nxt])
            nxt += 1
        for step in active:
            if seq == step.lo or (changed and seq <= step.hi):
                key = st.key(step)
                if key != step.tried:  # what it reads changed since it last tried
                    step.tried = key
                    await _try(step, st, seq, placed)
        active = [s for s in active if seq < s.hi and not s.done]
        if not active and nxt >= len(pending):
            return


def calls(steps: Iterable[Step]) -> list[Call]:
    return [c for s in steps for c in s.calls]


def rebuild_sync(messages: list[tuple[str, bytes, int, float]], block_id: str | None = None) -> list[Step]:
    return asyncio.run(rebuild(messages, block_id))
