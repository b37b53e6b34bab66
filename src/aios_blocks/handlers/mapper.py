"""The mapper's decisions: lifecycle facts -> the block's next instance map. Pure functions
``(fact, current map, block record) -> new map | None`` (``None``: no change); the mapper worker
(``workers/mapper.py``, ``blocks worker mapper``) stores the result in the instance-map bucket with compare-and-set
(``bus.instance_map``), so copies of the mapper never lose each other's changes.

The map of a block (one key per block; the bucket's revision is its version)::

    {"block_id", "gen", "cluster", "path", "method": the input protocol's, "loadBalancer": rule,
     "stabilityChecker": rule (only when the block names one),
     "minInstances": the spec's (0: scale-to-zero, the executor holds tasks while one starts),
     "outputs": whether the executor publishes its task outputs (side-cars),
     "tenant": the block's tenant (its ``tenant`` label; only a tenant's block has it),
     "instances": {iid: {"node", "endpoint", "state", "since"[, "boot", "health", "weight", "health_reason"]}},
     "boots": {node: the latest boot id of its agent (``node.inventory``, ``instance.added``)},
     "gone": [iid, ...]}

Boots (docs/executor.md "Agent restarts"): an instance's ``boot`` is that of the agent run that
reported it (``added``) or listed it (``node.inventory``); a ``ready`` instance whose ``boot`` is not
its node's latest in ``boots`` is not confirmed since its agent restarted, and the executors route
no task to it (it is still live: tasks wait). A map without ``boots`` (written before them) routes
as before.

A block of ``minInstances`` 0 is placed with no instance (no ``placement``): its map is made when
it becomes ``ready`` (``block.ready``), so the executors know it and hold its tasks.

States: ``starting`` (placed, not running yet), ``ready`` (``instance.added``: takes tasks),
``draining`` (a remove command was sent: no new task, tasks in flight finish), ``stopping``
(failed/unhealthy: no new task). ``instance.removed`` (or ``failed``) drops the instance and
remembers its id in ``gone`` (the last 256), so a late ``added`` never brings it back. A state
only moves forward (starting < ready < draining < stopping < gone): facts may arrive out of order
from mapper copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..schemas import protocol
from ..schemas.lifecycle import InstanceState
from ..schemas.records import BlockMap, BlockRecord, InstanceRecord, MapEntry

ORDER = {InstanceState.STARTING: 0, InstanceState.READY: 1, InstanceState.DRAINING: 2, InstanceState.STOPPING: 3}
GONE_KEEP = 256
#: the map's fields that come from the block record (``block_fields``)
BLOCK_KEYS = ("path", "method", "loadBalancer", "minInstances", "stabilityChecker", "outputs", "tenant")
DEFAULT_PATH = protocol.DEFAULT_TASK_PATH


def block_fields(block: BlockRecord | None) -> BlockMap:
    """What the executor needs from the block record: the input path, the loadBalancer rule and
    ``minInstances`` (0: scale-to-zero)."""
    ir = (block or {}).get("ir") or {}
    proto = ir.get("inputProtocol")
    proto = proto if isinstance(proto, dict) else {}
    policies = ir.get("policies") or {}
    rule = policies.get("loadBalancer") or {}
    out: BlockMap = {"path": protocol.task_path(proto), "method": protocol.task_method(proto), "loadBalancer": rule,
           "outputs": bool(ir.get("outputs") or ir.get("sidecars"))}
    if policies.get("stabilityChecker"):  # the health checker's (docs/health.md)
        out["stabilityChecker"] = policies["stabilityChecker"]
    mi = ir.get("minInstances")
    if isinstance(mi, int) and not isinstance(mi, bool):
        out["minInstances"] = mi
    labels = ir.get("labels")
    if isinstance(labels, dict) and labels.get("tenant"):  # whose users may send it tasks over HTTP
        out["tenant"] = str(labels["tenant"])
    if (block or {}).get("cluster"):
        out["cluster"] = str(block["cluster"])  # type: ignore[index]
    return out


#: a block on its way out or gone: a fact of it never makes its map anew
_GOING = frozenset({"deleting", "deleted"})


def _base(bid: str, gen: int, current: BlockMap | None, block: BlockRecord | None) -> BlockMap | None:
    """The map to change for a fact of generation ``gen`` (None: the fact is about an older one)."""
    if current is not None and int(current.get("gen", 0)) > gen:
        return None
    if current is None and block is not None and int(block.get("gen", -1)) == gen and block.get("status") in _GOING:
        # a fact of a deleted block handled after ``block.deleted`` deleted its map (the mapper
        # takes its facts concurrently: the instances' ``removed`` and the ``deleted`` a few ms
        # apart; a write that lost its compare-and-set to the deletion decides again on no map,
        # with the record it read, maybe still ``deleting``): it made the map anew, with no
        # instance, and the deleted block stayed in the bucket (the metrics collector sampled it
        # for ever, its /blocks listed it)
        return None
    if current is None or int(current.get("gen", 0)) < gen:
        current = {"block_id": bid, "gen": gen, "instances": {}, "gone": []}
    out: BlockMap = {**current, "instances": {k: v.copy() for k, v in current.get("instances", {}).items()},
                     "gone": list(current.get("gone", []))}
    if block is not None and int(block.get("gen", -1)) == gen:
        out.update(block_fields(block))
    out.setdefault("path", DEFAULT_PATH)
    out.setdefault("method", protocol.DEFAULT_TASK_METHOD)
    out.setdefault("loadBalancer", {})
    return out


def boot_time(boot: str) -> int:
    """When a boot id (``node_agent.new_boot``: ``<ms hex>-<random>``) was made; 0 if it does not say."""
    try:
        return int(boot.split("-", 1)[0], 16)
    except ValueError:
        return 0


def latest_boot(known: str | None, boot: str) -> str:
    """The later of two boot ids of one node (a late fact of an older run never wins)."""
    if not known:
        return boot
    return boot if boot_time(boot) >= boot_time(known) else known


def set_state(bid: str, gen: int, iid: str, state: InstanceState, current: BlockMap | None,
              block: BlockRecord | None, now: float, node: str = "", endpoint: str = "",
              boot: str = "") -> BlockMap | None:
    out = _base(bid, gen, current, block)
    if out is None or iid in out["gone"]:
        return None
    inst = out["instances"].get(iid)
    if _unchanged(out, current, inst, state, node, endpoint, boot):
        return None
    new: MapEntry = inst.copy() if inst else {}
    new["state"] = str(state)
    new["since"] = now
    if node:
        new["node"] = node
    if endpoint:
        new["endpoint"] = endpoint
    new.setdefault("node", node)
    new.setdefault("endpoint", "")
    if boot and new["node"]:
        new["boot"] = latest_boot(new.get("boot"), boot)
        boots = dict(out.get("boots") or {})
        boots[new["node"]] = latest_boot(boots.get(new["node"]), boot)
        out["boots"] = boots
    out["instances"][iid] = new
    return out


def _unchanged(out: BlockMap, current: BlockMap | None, inst: MapEntry | None, state: InstanceState,
               node: str, endpoint: str, boot: str) -> bool:
    """Whether a fact leaves the map as it is: about a copy on another node, older than what the
    map holds, already there, or a drain of an instance never seen running."""
    if inst is None:
        return state in (InstanceState.DRAINING, InstanceState.STOPPING) and not endpoint  # nothing routes to it
    if node and inst.get("node") and inst["node"] != node:
        return True  # a fact about a copy on another node (a duplicate being stopped)
    if ORDER[InstanceState(inst["state"])] > ORDER[state]:
        return True
    return _same(out, current, inst, state, endpoint, boot)


def _same(out: BlockMap, current: BlockMap | None, inst: MapEntry, state: InstanceState,
          endpoint: str, boot: str) -> bool:
    """The instance already holds this state (and endpoint, boot), and the block's fields are as stored."""
    return (inst["state"] == state and (not endpoint or inst.get("endpoint") == endpoint) and current is not None
            and (not boot or inst.get("boot") == boot) and all(out.get(k) == current.get(k) for k in BLOCK_KEYS))


def drop(bid: str, gen: int, iid: str, current: BlockMap | None, block: BlockRecord | None,
         node: str = "") -> BlockMap | None:
    out = _base(bid, gen, current, block)
    if out is None:
        return None
    inst = out["instances"].get(iid)
    if inst is not None and node and inst.get("node") and inst["node"] != node:
        return None
    if inst is None and iid in out["gone"]:
        return None
    out["instances"].pop(iid, None)
    out["gone"] = [*[g for g in out["gone"] if g != iid], iid][-GONE_KEEP:]
    return out


def on_added(ev: Any, current: BlockMap | None, block: BlockRecord | None, now: float) -> BlockMap | None:
    return set_state(ev.block_id, ev.gen, ev.instance_id, InstanceState.READY, current, block, now,
                     node=ev.node_id, endpoint=str(getattr(ev, "endpoint", "") or ""), boot=str(getattr(ev, "boot", "") or ""))


def on_inventory(inv: Any, current: BlockMap | None, now: float) -> BlockMap | None:
    """A node agent started (``node.inventory``): its boot becomes the node's latest in this map,
    and the instances it lists as running are confirmed under it. The map's other instances on that
    node are no longer routed to (their ``boot`` is an older run's) until the agent reports them
    again; the controller has those it lost removed. An inventory older than the node's latest
    boot changes nothing."""
    if current is None:
        return None
    nid, boot = inv.node_id, inv.boot
    boots = dict(current.get("boots") or {})
    if latest_boot(boots.get(nid), boot) != boot:
        return None
    runs = {i.instance_id for i in inv.instances}
    out: BlockMap = {**current, "instances": {k: v.copy() for k, v in current.get("instances", {}).items()},
                     "boots": {**boots, nid: boot}}
    for iid, rec in out["instances"].items():
        if rec.get("node") == nid and iid in runs:
            rec["boot"] = boot
    if out == current:
        return None
    return out


def on_remove_command(cmd: Any, current: BlockMap | None, block: BlockRecord | None, now: float) -> BlockMap | None:
    return set_state(cmd.block_id, cmd.gen, cmd.instance_id, InstanceState.DRAINING, current, block, now, node=cmd.node_id)


def on_failed(ev: Any, current: BlockMap | None, block: BlockRecord | None, now: float) -> BlockMap | None:
    """``failed`` / ``unhealthy``: no new task (the controller replaces or removes it)."""
    return set_state(ev.block_id, ev.gen, ev.instance_id, InstanceState.STOPPING, current, block, now, node=ev.node_id)


def on_removed(ev: Any, current: BlockMap | None, block: BlockRecord | None, now: float) -> BlockMap | None:
    return drop(ev.block_id, ev.gen, ev.instance_id, current, block, node=ev.node_id)


def on_placement(ev: Any, current: BlockMap | None, block: BlockRecord | None, now: float) -> BlockMap | None:
    out = current
    changed = False
    if getattr(ev, "cluster_id", "") and (current is None or current.get("cluster") != ev.cluster_id):
        base = _base(ev.block_id, ev.gen, current, block)
        if base is not None:
            out, changed = {**base, "cluster": ev.cluster_id}, True
    for p in ev.placements:
        nxt = set_state(ev.block_id, ev.gen, p.instance_id, InstanceState.STARTING, out, block, now, node=p.node_id)
        if nxt is not None:
            out, changed = nxt, True
    return out if changed else None


#: map health after each verdict (``handlers.stability``)
VERDICT_HEALTH = {"healthy": "ok", "degrade": "degraded", "unready": "unready", "restart": "unready", "replace": "unready"}


def on_verdict(ev: Any, current: BlockMap | None, block: BlockRecord | None, now: float) -> BlockMap | None:
    """A health checker verdict: the instance's ``health`` and routing ``weight``."""
    if current is None or int(current.get("gen", 0)) != ev.gen:
        return None
    inst = current.get("instances", {}).get(ev.instance_id)
    if inst is None or inst.get("state") != InstanceState.READY or (ev.node_id and inst.get("node") not in ("", ev.node_id)):
        return None
    health = VERDICT_HEALTH.get(ev.verdict)
    if health is None:
        return None
    weight = min(1.0, max(0.01, float(ev.weight))) if health == "degraded" else 1.0
    if inst.get("health", "ok") == health and float(inst.get("weight", 1.0)) == weight:
        return None
    out: BlockMap = {**current, "instances": {k: v.copy() for k, v in current.get("instances", {}).items()}}
    rec = out["instances"][ev.instance_id]
    rec["health"], rec["weight"] = health, weight
    rec["health_reason"] = str(ev.reason)[:300]
    if health == "ok":
        rec.pop("health_reason", None)
    return out


def on_ready(ev: Any, current: BlockMap | None, block: BlockRecord | None, now: float) -> BlockMap | None:
    """``block.ready``: the map exists with the block's fields, instances or none (a block of
    ``minInstances`` 0 has had no placement: this is its first map). No change: None."""
    if block is None or int(block.get("gen", -1)) != ev.gen or block.get("status") not in ("placing", "ready"):
        return None  # a late redelivery for a block since deleted or failed never brings its map back
    out = _base(ev.block_id, ev.gen, current, block)
    if out is None:
        return None
    if getattr(ev, "cluster_id", ""):
        out["cluster"] = ev.cluster_id
    if current is not None and all(out.get(k) == current.get(k) for k in ("block_id", "gen", "cluster", *BLOCK_KEYS)):
        return None
    return out


#: an instance record's status (Redis) -> its state in a map rebuilt from the state
_FROM_STATUS = {"starting": InstanceState.STARTING, "running": InstanceState.READY, "removing": InstanceState.DRAINING}


def from_state(bid: str, block: BlockRecord | None, instances: Mapping[str, InstanceRecord], now: float) -> BlockMap | None:
    """A block's map rebuilt from its state (its Redis record and instances), for a bucket that
    was lost and made anew: the block's fields, its starting and running instances, and those on
    their way out that were reachable (draining: no new task). ``None`` for a block that is not
    live (nothing to route to) or not ready yet with no instance."""
    if block is None or block.get("status") not in ("placing", "ready"):
        return None
    gen = int(block.get("gen", 0))
    out = _base(bid, gen, None, block)
    if out is None:
        return None
    for iid, rec in sorted(instances.items()):
        state = _FROM_STATUS.get(str(rec.get("status", "")))
        if state is None or int(rec.get("gen", gen)) != gen:
            continue
        endpoint = str(rec.get("endpoint") or "")
        if state is InstanceState.READY and not endpoint:
            state = InstanceState.STARTING  # running, but its address is not known yet
        if state is InstanceState.DRAINING and not endpoint:
            continue  # never reachable: nothing routes to it
        out["instances"][iid] = {"node": str(rec.get("node", "")), "endpoint": endpoint, "state": str(state), "since": now}
    if not out["instances"] and block.get("status") != "ready":
        return None
    return out
