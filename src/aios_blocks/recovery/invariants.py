"""The invariants every run must end in (``blocks check``; the chaos tests end with it).

1. every submitted block is accounted for: ready, failed with a reason, rejected with a reason, or
   deleted - none missing, none stuck (when the system is *settled*: nothing in flight);
2. no GPU holds more than its capacity, an exclusively held GPU has one holder, and every node's
   usage counters equal the sum of its reservation records (no leak, no double release);
3. no instance id runs twice: each reservation belongs to exactly one live instance record and
   each instance record has its reservation; the stream never shows one instance added on two
   nodes at once;
4. Redis equals the state rebuilt from the stream: same canonical digest (``recovery.image``);
5. no block is stuck: a block in flight whose latest event is older than ``stuck_after`` seconds
   is a violation even while the system runs (``--live``): nothing moves it any more (a step
   lost or dropped, a worker kind missing), and no other check would say so;
6. no create waits in ``AIOS_INTAKE`` unparsed (no ``submitted`` in ``AIOS`` yet, so the fold
   cannot see it): the parser's durable there has nothing pending (:func:`intake_waiting`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

import msgspec

from ..bus import subjects
from ..bus.nats_bus import Bus
from ..schemas.records import BlockIR
from ..schemas.spec import ID_RE
from ..schemas.vcluster import job_cluster_id
from ..state import keys
from ..state.store import Store
from . import image as im
from .rebuild import fold_stream, read_image

#: (``pending``: settled too, it waits for capacity by design; docs/priority.md)
TERMINAL = ("ready", "failed", "rejected", "deleted", "pending")
IN_FLIGHT = ("parsed", "selecting", "allocating", "placing", "deleting")
EPS = 1e-6


#: a Redis hash as an image holds it (``recovery.image``): field -> text
Hash = dict[str, str]


class ReportJSON(TypedDict):
    """A report as ``blocks check --json`` prints it (``Report.as_dict``)."""

    ok: bool
    violations: list[str]
    warnings: list[str]
    counts: dict[str, int]
    redis_digest: str
    stream_digest: str
    diff: list[str]


class _VcRec(TypedDict, total=False):
    """The fields of a virtual cluster's record (``schemas.vcluster.VClusterRecord`` as JSON) the
    checks read."""

    parent: str
    nodes: dict[str, str]


@dataclass
class Report:
    violations: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    redis_digest: str = ""
    stream_digest: str = ""
    counts: dict[str, int] = field(default_factory=dict)
    diff: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> ReportJSON:
        return {
            "ok": self.ok, "violations": self.violations, "warnings": self.warnings, "counts": self.counts,
            "redis_digest": self.redis_digest, "stream_digest": self.stream_digest, "diff": self.diff,
        }


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def check_image(
    img: im.Image, expected: set[str] | None = None, submitted: set[str] | None = None, settled: bool = True
) -> Report:
    """Invariants 1-3 over one image (pure: used on Redis's image and on the fold's)."""
    rep = Report()
    blocks, insts, nodes, res = _split(img)
    _not_hashes((("block", blocks), ("instances of block", insts), ("node", nodes), ("reservation", res)), rep)
    stuck = rep.violations if settled else rep.warnings
    # 1. blocks accounted for
    wanted = set(expected or set()) | {b for b in (submitted or set()) if ID_RE.match(b)}
    for bid in sorted(wanted - set(blocks)):
        stuck.append(f"block {bid}: submitted, but has no state (missing)")
    _blocks(blocks, insts, stuck, rep)
    # 2. capacity: node counters vs reservation records vs capacity
    want, owners = _reserved(res, nodes, rep)
    for nk, h in nodes.items():
        _node(nk, h, want.get(nk, {}), rep.violations)
    rep.counts["nodes"] = len(nodes)
    rep.counts["reservations"] = len(res)
    # 3. instances <-> reservations, one each
    _instances(insts, res, owners, rep)
    # and virtual clusters (seed 003): every node in exactly one place, records and places agree,
    # every instance inside its block's virtual cluster
    _vclusters(img, nodes, res, blocks, rep.violations if settled else rep.warnings, rep)
    return rep


def _not_hashes(groups: tuple[tuple[str, dict[str, Hash]], ...], rep: Report) -> None:
    """A record whose key holds another kind than a hash (a damaged key: a string, a set) is a
    violation, taken out of its group (the checks below read hashes: `blocks check` crashed on one
    with a traceback, where the invariants' report should say which key)."""
    for name, group in groups:
        for k in sorted(k for k, v in group.items() if not isinstance(v, dict)):
            kind = type(group.pop(k)).__name__.replace("str", "string")
            rep.violations.append(f"{name} {k}: its Redis key holds a {kind}, not a hash (`blocks recover --force` rebuilds it)")


def _split(img: im.Image) -> tuple[dict[str, Hash], dict[str, Hash], dict[str, Hash], dict[str, Hash]]:
    """The image's blocks and instance hashes (by block id), nodes and reservations (by key)."""
    blocks = {k.split(":", 2)[2]: v for k, v in img.items() if k.startswith("aios:block:") and not k.endswith(":inst")}
    insts = {k.split(":")[2]: v for k, v in img.items() if k.startswith("aios:block:") and k.endswith(":inst")}
    nodes = {k: v for k, v in img.items() if k.startswith("aios:{c:") and ":node:" in k}
    res = {k: v for k, v in img.items() if k.startswith("aios:{c:") and ":res:" in k}
    return blocks, insts, nodes, res


def _blocks(blocks: dict[str, Hash], insts: dict[str, Hash], stuck: list[str], rep: Report) -> None:
    """Each block's status is known and final (or in flight: ``stuck``), with what it implies."""
    statuses: dict[str, int] = {}
    for bid, b in blocks.items():
        status = b.get("status", "?")
        statuses[status] = statuses.get(status, 0) + 1
        if status in IN_FLIGHT:
            stuck.append(f"block {bid}: still {status}")
        elif status not in TERMINAL:
            rep.violations.append(f"block {bid}: unknown status {status!r}")
        elif status in ("failed", "rejected") and not b.get("reason"):
            rep.violations.append(f"block {bid}: {status} without a reason")
        elif status == "ready":
            _ready(bid, b, insts.get(bid, {}), stuck)
        elif status in ("deleted", "pending") and insts.get(bid):  # (a victim of a preemption drains)
            stuck.append(f"block {bid}: {status} but still has instances {sorted(insts[bid])}")
    rep.counts.update({f"blocks_{s}": n for s, n in statuses.items()})


def _ready(bid: str, b: Hash, insts: Hash, stuck: list[str]) -> None:
    """A ready block runs at least minInstances and holds at most maxInstances."""
    ir = msgspec.json.decode(b.get("ir", "{}"))
    running = sum(1 for v in insts.values() if msgspec.json.decode(v).get("status") == "running")
    if running < int(ir.get("minInstances", 0)):
        stuck.append(f"block {bid}: ready with {running} running instances < minInstances {ir.get('minInstances')}")
    if "maxInstances" in ir and len(insts) > int(ir["maxInstances"]):  # (a reassignment in flight holds one more)
        stuck.append(f"block {bid}: {len(insts)} instances > maxInstances {ir['maxInstances']}")


def _cluster_of(key: str) -> str:
    return key.split("{c:", 1)[1].split("}", 1)[0]


def _reserved(res: dict[str, Hash], nodes: dict[str, Hash], rep: Report) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """What the reservations add up to on each node's counters, and each instance's cluster."""
    want: dict[str, dict[str, float]] = {}
    owners: dict[str, str] = {}
    for key, r in res.items():
        cid, iid = _cluster_of(key), key.rsplit(":", 1)[1]
        if iid in owners:
            rep.violations.append(f"instance {iid}: reserved in two clusters ({owners[iid]}, {cid})")
        owners[iid] = cid
        nk = keys.node_key(cid, r.get("node", ""))
        w = want.setdefault(nk, {})
        w["cpu_used"] = w.get("cpu_used", 0.0) + _num(r.get("cpu"))
        w["mem_used"] = w.get("mem_used", 0.0) + _num(r.get("mem"))
        taken = msgspec.json.decode(r.get("gpus", "{}"))
        share = _num(r.get("share"))  # a sharing instance's thousandths of each GPU's compute (gpuShare)
        for g, m in (taken.items() if isinstance(taken, dict) else []):
            w[f"g:{g}:mem"] = w.get(f"g:{g}:mem", 0.0) + _num(m)
            w[f"g:{g}:n"] = w.get(f"g:{g}:n", 0.0) + 1
            if r.get("exclusive") == "1":
                w[f"g:{g}:x"] = 1.0
            if share:
                w[f"g:{g}:share"] = w.get(f"g:{g}:share", 0.0) + share
        if nk not in nodes:
            rep.violations.append(f"reservation {iid}: on node {r.get('node')} which is not registered in {cid}")
    return want, owners


def _node(nk: str, h: Hash, w: dict[str, float], out: list[str]) -> None:
    """One node's counters against its reservations, and its usage against its capacity."""
    counters = {f for f in h if f in ("cpu_used", "mem_used") or (f.startswith("g:") and not f.endswith(":total"))}
    for field_ in sorted(set(w) | counters):
        have, need = _num(h.get(field_)), w.get(field_, 0.0)
        if field_.endswith(":x"):
            if have != need:
                out.append(f"{nk}: {field_}={have:g} but reservations say {need:g}")
        elif abs(have - need) > EPS:
            out.append(f"{nk}: {field_}={have:g} but its reservations add up to {need:g}")
    if _num(h.get("cpu_used")) > _num(h.get("cpu")) + EPS:
        out.append(f"{nk}: cpu over capacity ({h.get('cpu_used')} > {h.get('cpu')})")
    if _num(h.get("mem_used")) > _num(h.get("memory")):
        out.append(f"{nk}: memory over capacity ({h.get('mem_used')} > {h.get('memory')})")
    for f, v in h.items():
        if not f.endswith(":total"):
            continue
        g = f[2:-6]
        if _num(h.get(f"g:{g}:mem")) > _num(v):
            out.append(f"{nk}: GPU {g} over capacity ({h.get(f'g:{g}:mem')} > {v} MiB)")
        if h.get(f"g:{g}:x") == "1" and _num(h.get(f"g:{g}:n")) > 1:
            out.append(f"{nk}: GPU {g} is exclusive but has {h.get(f'g:{g}:n')} holders")
        if _num(h.get(f"g:{g}:share")) > 1000:
            out.append(f"{nk}: GPU {g} compute over capacity ({h.get(f'g:{g}:share')} > 1000 thousandths)")


def _instances(insts: dict[str, Hash], res: dict[str, Hash], owners: dict[str, str], rep: Report) -> None:
    """Every instance holds one reservation on its node, and every reservation has its instance."""
    seen: dict[str, str] = {}
    for bid, h in insts.items():
        for iid, raw in h.items():
            inst = msgspec.json.decode(raw)
            if iid in seen:
                rep.violations.append(f"instance {iid}: recorded under blocks {seen[iid]} and {bid}")
            seen[iid] = bid
            r = res.get(keys.res_key(inst.get("cluster", ""), iid))
            if r is None:
                rep.violations.append(f"instance {iid} of {bid}: no reservation in {inst.get('cluster')}")
            elif r.get("node") != inst.get("node"):
                rep.violations.append(f"instance {iid} of {bid}: recorded on {inst.get('node')}, reserved on {r.get('node')}")
    for iid in sorted(set(owners) - set(seen)):
        rep.violations.append(f"reservation {iid} in {owners[iid]}: no instance holds it (leaked)")
    rep.counts["instances"] = len(seen)


def _vclusters(img: im.Image, nodes: dict[str, Hash], res: dict[str, Hash], blocks: dict[str, Hash], out: list[str],
               rep: Report) -> None:
    recs: dict[tuple[str, str], _VcRec] = {}
    for key, raw in img.items():
        if key.startswith("aios:{c:") and ":vc:" in key and isinstance(raw, str):
            recs[(_cluster_of(key), key.rsplit(":vc:", 1)[1])] = msgspec.json.decode(raw)
    place: dict[tuple[str, str], str] = {(_cluster_of(nk), nk.rsplit(":node:", 1)[1]): h.get("vc", "") for nk, h in nodes.items()}
    for (cid, nid), p in place.items():
        if p and nid not in (recs.get((cid, p)) or {}).get("nodes", {}):
            out.append(f"node {nid} of {cid}: placed in virtual cluster {p}, which does not list it")
    owner: dict[tuple[str, str], str] = {}
    for (cid, vid), r in sorted(recs.items()):
        _vc_record(cid, vid, r, recs, place, owner, out)
    for key, held in res.items():
        _vc_instance(key, held, blocks, place, out)
    rep.counts["vclusters"] = len(recs)


def _vc_record(cid: str, vid: str, r: _VcRec, recs: dict[tuple[str, str], _VcRec],
               place: dict[tuple[str, str], str], owner: dict[tuple[str, str], str], out: list[str]) -> None:
    """One virtual cluster's nodes: inside its divisible cluster (a job cluster), in no other
    virtual cluster, and placed in it (or in one of its job clusters)."""
    parent = r.get("parent")
    if parent:
        extra = sorted(set(r.get("nodes", {})) - set((recs.get((cid, parent)) or {}).get("nodes", {})))
        if extra:
            out.append(f"job cluster {vid}: nodes {extra} are not in its divisible cluster {parent}")
    jobs = {j for (c2, j), jr in recs.items() if c2 == cid and jr.get("parent") == vid}
    for nid in r.get("nodes", {}):
        if not parent:
            if (cid, nid) in owner:
                out.append(f"node {nid} of {cid}: in virtual clusters {owner[(cid, nid)]} and {vid}")
            owner[(cid, nid)] = vid
        at = place.get((cid, nid))
        if at is not None and at != vid and at not in jobs:
            out.append(f"node {nid} of {cid}: listed by {vid} but placed in {at or 'the primary'} (lost)")


def _vc_instance(key: str, r: Hash, blocks: dict[str, Hash], place: dict[tuple[str, str], str], out: list[str]) -> None:
    """A reservation's node is in its block's virtual cluster (or job cluster, or the primary)."""
    b = blocks.get(r.get("block", ""))
    if b is None:
        return
    raw = b.get("ir", "{}")
    ir: BlockIR = msgspec.json.decode(raw) if isinstance(raw, str) else cast(BlockIR, raw or {})
    want = ir.get("virtualClusterId") or ""
    if want and ir.get("jobCluster"):
        want = job_cluster_id(str(ir.get("blockId", "")))
    p = place.get((_cluster_of(key), r.get("node", "")), "")
    if p != want:
        out.append(f"instance {key.rsplit(':', 1)[1]} of {r.get('block')}: on {r.get('node')} in "
                   f"{p or 'the primary'}, its block's place is {want or 'the primary'}")


#: a block in flight with no event for this long is stuck (``blocks check --stuck-after``)
DEFAULT_STUCK_AFTER_S = 600.0


def stuck_blocks(img: im.Image, last_event: dict[str, tuple[float, str]], stuck_after: float,
                 now: float | None = None) -> list[str]:
    """Blocks in flight (or submitted and never parsed) whose latest stored event is older than
    ``stuck_after`` seconds, each with its status, age and last event."""
    now = time.time() if now is None else now
    status = {k.split(":", 2)[2]: v.get("status", "?") for k, v in img.items()
              if k.startswith("aios:block:") and not k.endswith(":inst") and isinstance(v, dict)}
    out = []
    for bid, (ts, tail) in sorted(last_event.items()):
        st = status.get(bid, "submitted" if ID_RE.match(bid) else None)
        if st in (*IN_FLIGHT, "submitted") and ts and now - ts > stuck_after:
            out.append(f"block {bid}: stuck {st} for {now - ts:.0f}s (no event since {tail}; limit {stuck_after:g}s)")
    return out


async def intake_waiting(bus: Bus) -> str | None:
    """Creates not yet taken by a parser: they sit in ``AIOS_INTAKE`` and have no ``submitted`` in
    ``AIOS`` yet, so the fold cannot see them (no parser running, or one that is behind)."""
    backlog = await bus.backlog(subjects.PARSER)
    if backlog is None:
        held = await bus.stream_messages(subjects.PARSER.stream)
        if held:
            return f"{held} create(s) wait in {subjects.PARSER.stream} and no parser has ever taken one (is a parser running?)"
        return None
    pending, unacked = backlog
    if pending or unacked:
        return (f"{pending + unacked} create(s) in {subjects.PARSER.stream} not yet parsed "
                f"({pending} not delivered, {unacked} delivered and not acked: is a parser running?)")
    return None


async def check(
    bus: Bus, store: Store, expected: set[str] | None = None, settled: bool = True,
    stuck_after: float = DEFAULT_STUCK_AFTER_S,
) -> Report:
    """All five invariants against the live servers. ``expected``: block ids that must be
    accounted for (default: every valid id with a create message in the stream)."""
    fold = await fold_stream(bus)
    img = await read_image(store.r, ("rebuilt", "unknown"))
    unknown = sorted(k for k in img if im.classify(k) == "unknown")
    rep = check_image(img, expected, set(fold.block_order), settled)
    stuck = stuck_blocks(img, fold.last_event, stuck_after)
    rep.violations += stuck
    rep.counts["blocks_stuck"] = len(stuck)
    if waiting := await intake_waiting(bus):
        (rep.violations if settled else rep.warnings).append(waiting)
    if unknown:
        rep.warnings.append(f"{len(unknown)} aios:* keys of unknown kind (not covered by the digest), e.g. {unknown[:3]}")
    for a in fold.anomalies:
        rep.violations.append(f"stream: {a}")
    if fold.undecodable:  # a live consumer dead-letters these: no state came of them, none is rebuilt
        rep.warnings.append(f"stream: {fold.undecodable} stored message(s) of a folded event whose data is not its payload")
    rebuilt = fold.image(include_gathers=False)
    rep.redis_digest, rep.stream_digest = im.digest(img), im.digest(rebuilt)
    if rep.redis_digest != rep.stream_digest:
        rep.diff = im.diff(img, rebuilt)
        (rep.violations if settled else rep.warnings).append(
            f"Redis state differs from the state rebuilt from the stream ({len(rep.diff)} keys shown in diff)"
        )
    rep.counts["events"] = fold.events
    return rep
