"""Virtual clusters (seed 003): the vocabulary, the records and the events about them.

A virtual cluster is a named set of whole nodes of one cluster (the *primary*):

* **indivisible**: blocks are placed on its nodes directly (several blocks share them);
* **divisible**: its nodes are carved into **job clusters**, one per block submitted to it with a
  ``jobCluster`` spec; the nodes not carved out are its *undivided* nodes;
* **job**: an indivisible cluster made for one block inside a divisible one, destroyed with it.

Every node of a cluster is in exactly one place: the primary's unassigned nodes, one indivisible
cluster, one divisible cluster's undivided nodes, or one job cluster. A node's place is the ``vc``
field of its Redis hash ("" = the primary) and ``virtualCluster`` in its node view.

A node's **type** is its ``nodeType`` label (e.g. the GPU model); a node without one has the type
of its first GPU's model, or ``cpu`` with no GPU. ``replicaSets`` are ``{type: count}``.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import Any

import msgspec

from .records import NodeView
from .spec import ID_RE

NODE_TYPE_LABEL = "nodeType"
PRIMARY = ""  # the place of a node no virtual cluster holds


class VClusterKind(enum.StrEnum):
    INDIVISIBLE = "indivisible"
    DIVISIBLE = "divisible"
    JOB = "job"


class VClusterOp(enum.StrEnum):
    """What a ``vcluster.changed`` / ``vcluster.refused`` event is about."""

    CREATE = "create"
    UPDATE = "update"
    REMOVE = "remove"
    #: dead nodes replaced (seed 003, "Raylet Failover")
    REPLENISH = "replenish"
    #: a job cluster carved for a block / destroyed with it
    JOB_CREATE = "job_create"
    JOB_REMOVE = "job_remove"
    #: grown or shrunk within its ``limits`` (beyond the seed: a block inside could not be
    #: placed / nodes stayed idle)
    AUTOSCALE = "autoscale"


def node_type(view: NodeView) -> str:
    """The node's type: its ``nodeType`` label, else its first GPU's model, else ``cpu``."""
    labels = view.get("labels") or {}
    t = labels.get(NODE_TYPE_LABEL)
    if t:
        return str(t)
    gpus = view.get("gpus") or []
    return str(gpus[0].get("model") or "gpu") if gpus else "cpu"


def job_cluster_id(bid: str) -> str:
    """The id of the job cluster made for block ``bid`` (a valid id however long ``bid`` is)."""
    base = f"job-{bid}"
    if len(base) <= 128:
        return base
    return f"job-{bid[:100]}-{hashlib.sha1(bid.encode()).hexdigest()[:10]}"


def replica_set_problems(value: Any, known_types: set[str] | None = None) -> list[str]:
    """Every problem of a ``replicaSets`` value: an object of node type -> count >= 0 (and, with
    ``known_types``, types some node of the cluster has)."""
    if not isinstance(value, dict):
        return [f"replicaSets must be an object of node type -> count, got {type(value).__name__}"]
    out = []
    for t, n in value.items():
        if not isinstance(t, str) or not t or len(t) > 256:
            out.append(f"node type {t!r} is not a non-empty string")
            continue
        if isinstance(n, bool) or not isinstance(n, int):
            out.append(f"count of {t!r} must be an integer, got {n!r}")
        elif n < 0:
            out.append(f"count of {t!r} must be >= 0, got {n}")
        if known_types is not None and t not in known_types:
            have = ", ".join(sorted(known_types)) or "none"
            out.append(f"no node of type {t!r} in the cluster (types: {have})")
    return out


def limit_problems(limits: Any, replica_sets: Any) -> list[str]:
    """Every problem of ``limits`` ({type: [min, max]}, 0 <= min <= max) against the counts."""
    if not isinstance(limits, dict):
        return [f"limits must be an object of node type -> [min, max], got {type(limits).__name__}"]
    out = []
    counts = replica_sets if isinstance(replica_sets, dict) else {}
    for t, mm in limits.items():
        if (not isinstance(mm, list) or len(mm) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in mm)
                or not 0 <= mm[0] <= mm[1]):
            out.append(f"limits of {t!r} must be [min, max] with 0 <= min <= max, got {mm!r}")
            continue
        n = counts.get(t, 0)
        if isinstance(n, int) and not mm[0] <= n <= mm[1]:
            out.append(f"count of {t!r} ({n}) is outside its limits {mm}")
    return out


def id_problem(vid: Any) -> str:
    if not isinstance(vid, str) or not ID_RE.match(vid):
        return f"virtual cluster id {vid!r} is not a valid id: letters, digits, '-' and '_', at most 128"
    return ""


class VClusterRecord(msgspec.Struct, omit_defaults=True):
    """A virtual cluster as stored (Redis ``aios:{c:<cid>}:vc:<vid>``, JSON) and as carried by
    its ``changed`` events. ``nodes`` are the nodes whose place it is (for a divisible cluster:
    its undivided nodes; its job clusters list theirs)."""

    id: str
    cluster: str
    kind: VClusterKind
    revision: int
    replica_sets: dict[str, int]
    #: node id -> node type
    nodes: dict[str, str] = {}
    #: a job cluster's divisible cluster
    parent: str = ""
    #: a job cluster's block
    block: str = ""
    #: the last request applied (a redelivered request finds it and publishes the same outcome)
    request_id: str = ""
    #: the stream sequence of the request that created it (ids stay unique when an id is reused)
    gen: int = 0
    #: node type -> [min, max]: autoscaled within them (beyond the seed); absent: manual only
    limits: dict[str, list[int]] = {}


# -- requests (admin publishes; the vcluster consumer decides) ------------------------------------
class VClusterCreate(msgspec.Struct, omit_defaults=True):
    vcluster_id: str
    cluster_id: str
    replica_sets: dict[str, Any]
    request_id: str
    divisible: bool = False
    limits: dict[str, Any] = {}


class VClusterUpdate(msgspec.Struct, omit_defaults=True):
    vcluster_id: str
    revision: int
    replica_sets: dict[str, Any]
    request_id: str
    #: given only to (try to) change it: refused, a virtual cluster keeps its kind
    divisible: bool | None = None
    #: new autoscaling limits (absent: kept)
    limits: dict[str, Any] | None = None


class VClusterRemove(msgspec.Struct, omit_defaults=True):
    vcluster_id: str
    request_id: str


# -- outcomes (stored; ``blocks recover`` rebuilds the virtual clusters from ``changed``) ---------
class VClusterChanged(msgspec.Struct, omit_defaults=True):
    """The virtual cluster after one change: the whole record (``removed``: it is gone), the nodes
    that moved (node -> [from, to], "" = the primary), and why."""

    vcluster_id: str
    cluster_id: str
    op: VClusterOp
    record: VClusterRecord
    gen: int = 0
    #: the record's revision after the change (a removal: the last revision + 1)
    revision: int = 0
    moved: dict[str, list[str]] = {}
    removed: bool = False
    request_id: str = ""
    reason: str = ""
    #: the seed's "publish to all raylets" (False: the seed's "flush to storage only")
    published: bool = True
    #: the cluster's state index after the change: the order of a cluster's changes, whatever
    #: order their events were stored in (the recovery fold applies each node's latest)
    index: int = 0
    #: when it was committed (epoch seconds)
    at: float = 0.0


class VClusterRefused(msgspec.Struct, omit_defaults=True):
    """A request refused whole, with every reason; ``revision`` is the current one (0: none)."""

    vcluster_id: str
    op: VClusterOp
    reason: str
    request_id: str = ""
    revision: int = 0
    cluster_id: str = ""


# -- a change to commit (``handlers.vcluster`` plans it, ``state.vcluster`` applies it) -----------
@dataclass(frozen=True)
class RecordWrite:
    vid: str
    #: None: no check; -1: must not exist; n: its revision must be n
    expect: int | None
    #: the new record (None: delete it)
    record: VClusterRecord | None


@dataclass(frozen=True)
class NodeMove:
    node: str
    src: str
    dst: str
    idle: bool = True
    alive: bool = True




# -- node and cluster lifecycle that virtual clusters need (``blocks node drain|remove``,
# ``blocks cluster remove``); stored so ``blocks recover`` rebuilds them -------------------------
class NodeDrain(msgspec.Struct, omit_defaults=True):
    """A node drained (no new placements; its instances are moved away, reason ``evacuation``)
    or undrained (``drain`` false)."""

    node_id: str
    cluster_id: str
    request_id: str
    drain: bool = True
    #: instances asked to move (reassignment requests published with it)
    evacuating: list[str] = []


class NodeRemoved(msgspec.Struct):
    """A drained, idle node removed from its cluster."""

    node_id: str
    cluster_id: str
    request_id: str


class ClusterRemoved(msgspec.Struct):
    """A cluster with nothing running and no virtual cluster removed, with its nodes."""

    cluster_id: str
    request_id: str
    nodes: list[str] = []
