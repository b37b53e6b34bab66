"""The one Redis key grammar: every key the system writes, built here and nowhere else (the store,
the recovery fold's image, the invariants and the CLI all use these).

Key layout (``{c:<cid>}`` is a hash tag: all capacity keys of one cluster share a slot)::

    aios:component:<uri>              JSON of a registered component
    aios:clusters                     hash cid -> JSON {id, labels}
    aios:{c:<cid>}:nodes              set of node ids
    aios:{c:<cid>}:node:<nid>         hash: spec (JSON), cpu, memory, healthy, cpu_used, mem_used,
                                      g:<gpu>:total|mem|n|x   (capacity and usage per GPU)
    aios:{c:<cid>}:res:<iid>          hash: one instance's reservation (node, cpu, mem, gpus)
    aios:nodeindex                    hash nid -> cid
    aios:block:<bid>                  hash: status, version, gen, cluster, ir, reason, ...
    aios:blocks                       sorted set of block ids by creation time
    aios:block:<bid>:inst             hash iid -> JSON {node, gpus, status, cluster}
    aios:nodeinst:<nid>               hash iid -> bid: instances recorded on a node (agent reconcile)
    aios:heartbeats                   sorted set nid -> last heartbeat time (agent-served nodes)
    aios:gather:<bid>:<gen>:<n>        hash: expected, deadline, r:<cid> answers, decided (deleted once its decision is stored)
    aios:gather:due                    zset: bid|gen|n of open gathers by deadline (the gateways' timers)
    aios:aff:svc:<block uuid>         hash iid -> [node, rack] (affinity ServiceId targets)
    aios:aff:lease                    hash instance uuid -> node (affinity LeaseId targets)
    aios:ctx:<rule id>                hash: a policy rule's shared context (JSON values)
    aios:policy:<name>                hash: source, version, language, updated (policy registry)
    aios:meta:epoch                   state epoch: present while Redis holds valid state
    aios:metrics:targets              zset: JSON of a worker's /metrics target -> when it lapses
    aios:metrics:leader:<scope>       the metrics collector that holds a scope (``all`` or a cluster id)
    aios:metrics:blocks               hash bid -> JSON of the block's latest metrics sample
    aios:metrics:{b:<bid>}:inst       hash iid -> JSON of the instance's latest metrics sample
    aios:metrics:{b:<bid>}:win        list: the block's samples, newest first (bounded, TTL)
    aios:metrics:{b:<bid>}:win:<iid>  list: the instance's samples, newest first (bounded, TTL)
    aios:meta:{b:<bid>}:as:lease      the autoscaler copy that decides for the block (SET NX PX, renewed)
    aios:meta:{b:<bid>}:as:state      the autoscaler's memory of the block (proposals, delays, burst)
    aios:meta:{b:<bid>}:replace:<iid> the reassignment request that is replacing the instance now
                                      (SET PX, a lease: one replacement at a time, on any copy)
    aios:meta:autoscalers             zset: the live autoscaler copies, scored by when they lapse
    aios:meta:{b:<bid>}:moves         hash move id -> JSON of a make-before-break move's claim (its
                                      phase; finished ones kept a while: a redelivery is one move)
    aios:meta:{c:<cid>}:moverate      zset move id -> when it started (the cluster's move rate limit)
    aios:meta:moves:due               zset bid|move id -> when an open move is looked at again (sweep)
    aios:health:{b:<bid>}:passive     hash executor id -> JSON of its per-instance passive counts (TTL)
    aios:health:lease:<bid>           the health checker copy that decides a block now
    aios:health:{b:<bid>}:failed      hash reason digest -> when a failing tick was last recorded (TTL)
    aios:health:suspect               hash nid -> JSON {since, until, reason}: nodes every probed
                                      instance of which fails (no placement there until ``until``)
    aios:health:reconcile:lease       the controller copy whose reconciler runs now
    aios:health:reconcile:state       hash bid -> JSON: the reconciler's memory of a block that is short
    aios:health:announce              hash event id -> JSON {bid, gen, target, at, events}: a status step's
                                      events not yet acked by the stream (set before the step's CAS, dropped
                                      after the publish; the reconciler publishes what stays)
    aios:meta:{c:<cid>}:index         the cluster's state index: a counter bumped by every change a
                                      placement depends on (see ``Store.state_index``)
    aios:{c:<cid>}:vcs                set of the cluster's virtual cluster ids (seed 003)
    aios:{c:<cid>}:vc:<vid>           JSON of one virtual cluster (``schemas.vcluster.VClusterRecord``);
                                      a node's place is the ``vc`` field of its node hash (absent: the
                                      primary's unassigned nodes)
    aios:vcindex                      hash vid -> cid (which cluster a virtual cluster id is in)
    aios:meta:{c:<cid>}:vcout         hash: virtual cluster changes committed, not yet published
    aios:priorityclasses              hash name -> JSON of a priority class (docs/priority.md)
    aios:quotas                       hash tenant -> JSON of its quota (docs/priority.md)
"""

from __future__ import annotations

P = "aios"

EPOCH_KEY = f"{P}:meta:epoch"
CLUSTERS = f"{P}:clusters"
NODE_INDEX = f"{P}:nodeindex"
BLOCKS = f"{P}:blocks"
HEARTBEATS = f"{P}:heartbeats"
AFF_LEASE = f"{P}:aff:lease"
POLICIES = f"{P}:policies"
#: priority classes and tenants' quotas (``state.priority``; rebuilt from the stream)
PRIORITY_CLASSES = f"{P}:priorityclasses"
QUOTAS = f"{P}:quotas"
#: every open gather's deadline timer (zset: ``bid|gen|attempt`` scored by when it is due)
GATHER_DUE = f"{P}:gather:due"


#: virtual cluster id -> its cluster (``state.vcluster``)
VC_INDEX = f"{P}:vcindex"


def vc_key(cid: str, vid: str) -> str:
    return f"{P}:{{c:{cid}}}:vc:{vid}"


def vc_set_key(cid: str) -> str:
    return f"{P}:{{c:{cid}}}:vcs"


def vc_outbox_key(cid: str) -> str:
    """The cluster's virtual cluster changes committed and not yet published (a hash; volatile:
    under ``aios:meta:``, with the cluster's hash tag so the commit script writes it)."""
    return f"{P}:meta:{{c:{cid}}}:vcout"


def component_key(uri: str) -> str:
    return f"{P}:component:{uri}"


def cluster_nodes_key(cid: str) -> str:
    return f"{P}:{{c:{cid}}}:nodes"


def node_key(cid: str, nid: str) -> str:
    return f"{P}:{{c:{cid}}}:node:{nid}"


def res_key(cid: str, iid: str) -> str:
    return f"{P}:{{c:{cid}}}:res:{iid}"


def res_pattern(cid: str) -> str:
    return f"{P}:{{c:{cid}}}:res:*"


def index_key(cid: str) -> str:
    """The cluster's state index. Under ``aios:meta:`` (volatile: not rebuilt from the stream, left
    out of the state digest) but with the cluster's hash tag, so the capacity scripts can bump it
    in the same Redis Cluster slot as the nodes and reservations they change."""
    return f"{P}:meta:{{c:{cid}}}:index"


def quota_usage_key(cid: str) -> str:
    """Quota usage held in the cluster (issue 36, docs/priority.md "Quota gating"): hash
    ``tenant<TAB>model<TAB>resource`` -> amount, changed by the capacity scripts in the same call
    (and Redis Cluster slot) as the reservation they take or give back. Under ``aios:meta:``: left
    out of the state digest, rebuilt by ``blocks recover`` from the reservations the stream folds to."""
    return f"{P}:meta:{{c:{cid}}}:quota"


def quota_res_key(cid: str) -> str:
    """What each reservation added to ``quota_usage_key`` (hash iid -> JSON ``{field: amount}``), so
    that its release takes back exactly that."""
    return f"{P}:meta:{{c:{cid}}}:quota:res"


def index_cluster(key: str) -> str:
    """The cluster id of an ``index_key``."""
    return key.removeprefix(f"{P}:meta:{{c:").removesuffix("}:index")


def block_key(bid: str) -> str:
    return f"{P}:block:{bid}"


def inst_key(bid: str) -> str:
    return f"{P}:block:{bid}:inst"


def node_inst_key(nid: str) -> str:
    return f"{P}:nodeinst:{nid}"


def gather_key(bid: str, gen: int, attempt: int = 0) -> str:
    return f"{P}:gather:{bid}:{gen}:{attempt}"


def due_member(bid: str, gen: int, attempt: int) -> str:
    return f"{bid}|{gen}|{attempt}"


def aff_svc_key(svc: str) -> str:
    return f"{P}:aff:svc:{svc}"


def ctx_key(rule_id: str) -> str:
    return f"{P}:ctx:{rule_id}"


def policy_key(name: str) -> str:
    return f"{P}:policy:{name}"


def policy_version_key(name: str, version: int | str) -> str:
    return f"{P}:policy:{name}:v{version}"


# -- metrics (volatile: the collector's windows, rebuilt by scraping, never from the stream) --------
METRICS = f"{P}:metrics"
METRICS_TARGETS = f"{METRICS}:targets"
METRICS_BLOCKS = f"{METRICS}:blocks"


def metrics_leader_key(scope: str) -> str:
    return f"{METRICS}:leader:{scope}"


def metrics_inst_key(bid: str) -> str:
    return f"{METRICS}:{{b:{bid}}}:inst"


def metrics_win_key(bid: str, iid: str | None = None) -> str:
    return f"{METRICS}:{{b:{bid}}}:win" + (f":{iid}" if iid else "")


# -- autoscaler (volatile: its lease and its memory of each block, never from the stream) ----------
def autoscale_lease_key(bid: str) -> str:
    return f"{P}:meta:{{b:{bid}}}:as:lease"


def autoscale_state_key(bid: str) -> str:
    return f"{P}:meta:{{b:{bid}}}:as:state"


def replace_claim_key(bid: str, iid: str) -> str:
    return f"{P}:meta:{{b:{bid}}}:replace:{iid}"


def move_key(bid: str) -> str:
    """A block's make-before-break moves (``state.moves``)."""
    return f"{P}:meta:{{b:{bid}}}:moves"


def move_rate_key(cid: str) -> str:
    """The moves started in a cluster lately (its rate limit, ``state.moves``)."""
    return f"{P}:meta:{{c:{cid}}}:moverate"


#: every open move's next look (the sweep of ``workers.moves``)
MOVES_DUE = f"{P}:meta:moves:due"


# -- health (volatile: the executors' passive counts, the checker's lease; docs/health.md) -----------
HEALTH = f"{P}:health"


def health_passive_key(bid: str) -> str:
    return f"{HEALTH}:{{b:{bid}}}:passive"


def health_lease_key(bid: str) -> str:
    return f"{HEALTH}:lease:{bid}"


def health_failed_key(bid: str) -> str:
    return f"{HEALTH}:{{b:{bid}}}:failed"


#: suspect nodes (the health checker's marks; docs/health.md "Suspect nodes")
SUSPECT = f"{HEALTH}:suspect"
#: the reconciler: its lease (one controller copy at a time) and its memory of short blocks
RECONCILE_LEASE = f"{HEALTH}:reconcile:lease"
RECONCILE_STATE = f"{HEALTH}:reconcile:state"
#: the latest failed scale / reassignment step per block, as the controller noted it (the reason a
#: short block's mark gives; docs/reliability.md "Short blocks")
RECONCILE_FAILED = f"{HEALTH}:reconcile:failed"
#: status steps' announcements not yet acked by the stream (``state.announce``)
ANNOUNCE = f"{HEALTH}:announce"


#: the live autoscaler copies (zset: holder -> when its registration lapses); blocks are split among them
AUTOSCALERS = f"{P}:meta:autoscalers"
