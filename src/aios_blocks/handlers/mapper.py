"""The mapper's decisions: lifecycle facts -> the block's next instance map. Pure functions
``(fact, current map, block record) -> new map | None`` (``None``: no change); the mapper worker
(``workers/executor.py``) stores the result in the instance-map bucket with compare-and-set
(``bus.instance_map``), so copies of the mapper never lose each other's changes.

The map of a block (one key per block; the bucket's revision is its version)::

    {"block_id", "gen", "cluster", "path", "method": the input protocol's, "loadBalancer": rule,
     "outputs": whether the executor publishes its task outputs (side-cars),
     "instances": {iid: {"node", "endpoint", "state", "since"}}, "gone": [iid, ...]}

States: ``starting`` (placed, not running yet), ``ready`` (``instance.added``: takes tasks),
``draining`` (a remove command was sent: no new task, tasks in flight finish), ``stopping``
(failed/unhealthy: no new task). ``instance.removed`` (or ``failed``) drops the instance and
remembers its id in ``gone`` (the last 256), so a late ``added`` never brings it back. A state
only moves forward (starting < ready < draining < stopping < gone): facts may arrive out of order
from mapper copies.
"""

from __future__ import annotations

from typing import Any

from ..executor.engine import InstanceState
from ..schemas import protocol

ORDER = {InstanceState.STARTING: 0, InstanceState.READY: 1, InstanceState.DRAINING: 2, InstanceState.STOPPING: 3}
GONE_KEEP = 256
DEFAULT_PATH = protocol.DEFAULT_TASK_PATH


def block_fields(block: dict[str, Any] | None) -> dict[str, Any]:
    """What the executor needs from the block record: the input path and the loadBalancer rule."""
    ir = (block or {}).get("ir") or {}
    proto = ir.get("inputProtocol")
    proto = proto if isinstance(proto, dict) else {}
    rule = (ir.get("policies") or {}).get("loadBalancer") or {}
    out = {"path": protocol.task_path(proto), "method": protocol.task_method(proto), "loadBalancer": rule,
           "outputs": bool(ir.get("outputs") or ir.get("sidecars"))}
    if (block or {}).get("cluster"):
        out["cluster"] = str(block["cluster"])  # type: ignore[index]
    return out


def _base(bid: str, gen: int, current: dict[str, Any] | None, block: dict[str, Any] | None) -> dict[str, Any] | None:
    """The map to change for a fact of generation ``gen`` (None: the fact is about an older one)."""
    if current is not None and int(current.get("gen", 0)) > gen:
        return None
    if current is None or int(current.get("gen", 0)) < gen:
        current = {"block_id": bid, "gen": gen, "instances": {}, "gone": []}
    out = {**current, "instances": {k: dict(v) for k, v in current.get("instances", {}).items()},
           "gone": list(current.get("gone", []))}
    if block is not None and int(block.get("gen", -1)) == gen:
        out.update(block_fields(block))
    out.setdefault("path", DEFAULT_PATH)
    out.setdefault("method", protocol.DEFAULT_TASK_METHOD)
    out.setdefault("loadBalancer", {})
    return out


def set_state(bid: str, gen: int, iid: str, state: InstanceState, current: dict[str, Any] | None,
              block: dict[str, Any] | None, now: float, node: str = "", endpoint: str = "") -> dict[str, Any] | None:
    out = _base(bid, gen, current, block)
    if out is None or iid in out["gone"]:
        return None
    inst = out["instances"].get(iid)
    if inst is not None:
        if node and inst.get("node") and inst["node"] != node:
            return None  # a fact about a copy on another node (a duplicate being stopped)
        if ORDER[InstanceState(inst["state"])] > ORDER[state]:
            return None
        if inst["state"] == state and (not endpoint or inst.get("endpoint") == endpoint) and current is not None \
                and all(out.get(k) == current.get(k) for k in ("path", "method", "loadBalancer", "outputs")):
            return None
    elif state in (InstanceState.DRAINING, InstanceState.STOPPING) and not endpoint:
        return None  # never seen running: nothing routes to it
    new = dict(inst or {})
    new["state"] = str(state)
    new["since"] = now
    if node:
        new["node"] = node
    if endpoint:
        new["endpoint"] = endpoint
    new.setdefault("node", node)
    new.setdefault("endpoint", "")
    out["instances"][iid] = new
    return out


def drop(bid: str, gen: int, iid: str, current: dict[str, Any] | None, block: dict[str, Any] | None,
         node: str = "") -> dict[str, Any] | None:
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


def on_added(ev: Any, current: dict[str, Any] | None, block: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    return set_state(ev.block_id, ev.gen, ev.instance_id, InstanceState.READY, current, block, now,
                     node=ev.node_id, endpoint=str(getattr(ev, "endpoint", "") or ""))


def on_remove_command(cmd: Any, current: dict[str, Any] | None, block: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    return set_state(cmd.block_id, cmd.gen, cmd.instance_id, InstanceState.DRAINING, current, block, now, node=cmd.node_id)


def on_failed(ev: Any, current: dict[str, Any] | None, block: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    """``failed`` / ``unhealthy``: no new task (the controller replaces or removes it)."""
    return set_state(ev.block_id, ev.gen, ev.instance_id, InstanceState.STOPPING, current, block, now, node=ev.node_id)


def on_removed(ev: Any, current: dict[str, Any] | None, block: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    return drop(ev.block_id, ev.gen, ev.instance_id, current, block, node=ev.node_id)


def on_placement(ev: Any, current: dict[str, Any] | None, block: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
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
