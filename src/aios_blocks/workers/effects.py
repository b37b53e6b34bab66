"""The one adapter that commits effects (``handlers/effects.py``) to Redis and NATS, in order.
Every effect is idempotent, so a redelivered message whose decision is re-run and re-committed
changes nothing twice (the stream deduplicates the events by their catalog id rule)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from .. import faults
from ..bus.catalog import E, Emit
from ..handlers.effects import (
    DeletedIfEmpty,
    Effect,
    Publish,
    ReadyIfRunning,
    Release,
    RemoveAll,
    Replace,
    SetInstance,
    Transition,
)
from ..handlers.lifecycle import remove_command
from ..policies.affinity import uid
from ..schemas.events import BlockStatusReport, ReassignRequest
from ..schemas.lifecycle import TRANSITIONS, InstanceStatus, Step
from ..schemas.records import InstanceRecord
from . import announce
from .base import Worker


async def commit(w: Worker, effects: Iterable[Effect]) -> None:
    #: a block's instances as read atomically with this commit's last write (``SetInstance``):
    #: a guard right after it needs no read of its own
    fresh: Fresh = []
    for effect in effects:
        if not await _one(w, effect, fresh):
            return  # a guard failed (the instance is gone): the rest depended on it


Fresh = list[tuple[str, Mapping[str, InstanceRecord]]]
Seen = tuple[str, Mapping[str, InstanceRecord]] | None


async def _one(w: Worker, e: Effect, fresh: Fresh) -> bool:
    """Commit one effect; ``False``: its guard failed (the effects after it depended on it)."""
    seen = fresh.pop() if fresh else None  # good for the effect right after the write only
    do = _DO.get(type(e))
    if do is None:
        raise TypeError(f"unknown effect {e!r}")
    return await do(w, e, seen, fresh)


async def _publish(w: Worker, e: Publish, seen: Seen, fresh: Fresh) -> bool:
    await w.bus.emit_all(e.events)
    if seen is not None:
        fresh.append(seen)  # publishing changes no state
    return True


async def _set_instance(w: Worker, e: SetInstance, seen: Seen, fresh: Fresh) -> bool:
    rec, insts = await w.store.set_instance_status_all(e.block_id, e.instance_id, e.status.value, e.endpoint)
    if rec is None:
        return False
    fresh.append((e.block_id, insts))
    return True


async def _transition(w: Worker, e: Transition, seen: Seen, fresh: Fresh) -> bool:
    kw: dict[str, Any] = dict(e.fields)
    # what the step announces is marked pending first: a step taken whose publish fails is
    # published again by the reconciler, even if the redelivery decides otherwise (announce)
    key = await announce.mark(w, e.block_id, e.gen, e.step, [ev for t in e.then if isinstance(t, Publish) for ev in t.events])
    ok, info = await w.store.transition(e.block_id, e.gen, e.step, **kw)
    moved = ok or info == TRANSITIONS[e.step].target
    if ok or (e.redo and moved):
        await commit(w, e.then)
    await announce.settle(w, key, moved)
    return True


async def _release(w: Worker, e: Release, seen: Seen, fresh: Fresh) -> bool:
    await release(w, e.block_id, e.instance_id, e.instance)
    return True


async def _ready_if_running(w: Worker, e: ReadyIfRunning, seen: Seen, fresh: Fresh) -> bool:
    insts = seen[1] if seen is not None and seen[0] == e.block_id else await w.store.instances(e.block_id)
    if sum(1 for i in insts.values() if i["status"] == InstanceStatus.RUNNING) >= e.min_instances:
        await _ready(w, e.block_id, e.gen, e.cluster_id, e.step, sorted(insts))
    return True


async def _deleted_if_empty(w: Worker, e: DeletedIfEmpty, seen: Seen, fresh: Fresh) -> bool:
    # read after our own drop: two removals handled at once must not each still see the
    # other's instance (then neither would mark the block deleted)
    if not await w.store.instances(e.block_id):
        deleted = BlockStatusReport(e.block_id, e.gen, "deleted")
        await commit(w, [Transition(e.block_id, e.gen, Step.DELETED, then=(Publish((Emit(E.block_deleted, deleted),)),))])
    return True


async def _remove_all(w: Worker, e: RemoveAll, seen: Seen, fresh: Fresh) -> bool:
    for iid, rec in (await w.store.instances(e.block_id)).items():
        await w.store.set_instance_status(e.block_id, iid, InstanceStatus.REMOVING.value)
        await w.bus.emit_all([remove_command(e.block_id, e.gen, rec["cluster"], iid, rec["node"], e.reason)])
    return True


async def _replace(w: Worker, e: Replace, seen: Seen, fresh: Fresh) -> bool:
    req = ReassignRequest(e.block_id, e.cluster_id, e.request_id, e.instance_id, e.reason, gen=e.gen, avoid_node=e.avoid_node, at=round(time.time(), 3))
    ack = await w.bus.emit(E.cluster_reassignment, req, sync=True)
    if not getattr(ack, "duplicate", False):
        # counted once per request, as the stream holds it once (a redelivered fault is
        # deduplicated; recover counts the stored requests): the limit is not reached early
        await w.store.block_bump(e.block_id, "replacements")
    return True


#: effect type -> how it is committed
_DO: dict[type, Callable[[Worker, Any, Seen, Fresh], Awaitable[bool]]] = {
    Publish: _publish, SetInstance: _set_instance, Transition: _transition, Release: _release,
    ReadyIfRunning: _ready_if_running, DeletedIfEmpty: _deleted_if_empty, RemoveAll: _remove_all, Replace: _replace,
}


async def commit_added(w: Worker, effects: list[Effect], insts: Mapping[str, InstanceRecord]) -> None:
    """An ``added``'s effects (``lifecycle.on_added``; ``insts``: its block's instance records as
    read with the block). The common one, the instance ``running`` and then its block ready when
    enough run, goes to Redis as one exchange when ``insts`` says the write makes the block ready:
    the ready's announcement mark (of the instances read), then one script that sets the status and
    takes the ``ready`` step only if as many run and the block has those instances
    (``Store.set_status_then_ready``), which is what ``commit`` decides from the instances right
    after the write. Otherwise, and on a Redis Cluster (two slots), ``commit`` as before."""
    pair = _makes_ready(w, effects, insts)
    if pair is None:
        await commit(w, effects)
        return
    s, r = pair
    ids = sorted(insts)
    ready = ready_event(r.block_id, r.gen, r.cluster_id, ids)
    mark = announce.entry(r.block_id, r.gen, r.step, [ready])
    key = mark[1]
    rec, after, cas = await w.store.set_status_then_ready(s.block_id, s.instance_id, s.status.value, s.endpoint, r.min_instances,
                                                          ids, r.gen, r.step, mark=mark)
    if cas is None:  # not tried: the instance gone (nothing written, nothing after it), or other records
        await announce.settle(w, key, False)
        if rec is not None:
            await _ready_if_running(w, r, (r.block_id, after), [])
        return
    await _announced(w, r.step, key, *cas, ready)


def _makes_ready(w: Worker, effects: list[Effect], insts: Mapping[str, InstanceRecord]
                 ) -> tuple[SetInstance, ReadyIfRunning] | None:
    """``effects`` when they are an instance set ``running`` and then its block's ready, which the
    records ``insts`` say the write makes ready, on one Redis server; else None."""
    if len(effects) != 2 or not w.store.one_server:
        return None
    s, r = effects
    if not (isinstance(s, SetInstance) and isinstance(r, ReadyIfRunning)) or s.block_id != r.block_id \
            or s.status != InstanceStatus.RUNNING or s.instance_id not in insts:
        return None
    running = sum(1 for iid, i in insts.items() if iid == s.instance_id or i["status"] == InstanceStatus.RUNNING)
    return (s, r) if running >= r.min_instances else None


def ready_event(bid: str, gen: int, cid: str, instances: list[str]) -> Emit:
    """A block's ``ready``, listing its instances (sorted)."""
    return Emit(E.block_ready, BlockStatusReport(bid, gen, "ready", "", cid, instances), qualifier=ready_qualifier(bid, instances))


async def _announced(w: Worker, step: Step, key: str, ok: bool, info: str, ready: Emit) -> None:
    """After the ``ready`` step's CAS (``ok``, ``info``): published if the block is ready (a
    redelivery after the CAS re-publishes, deduplicated), and its mark settled."""
    moved = ok or info == TRANSITIONS[step].target
    if moved:
        faults.hit("lifecycle.ready.stored")  # the chaos test's SIGKILL: ready in Redis, not announced
        await w.bus.emit_all([ready])
    await announce.settle(w, key, moved)


async def _ready(w: Worker, bid: str, gen: int, cid: str, step: Step, instances: list[str]) -> None:
    ready = ready_event(bid, gen, cid, instances)
    # marked before the CAS: if the publish fails and the redelivery finds the instance gone (lost,
    # replaced meanwhile: the replacement's ``added`` sees the block ready already), the
    # reconciler still publishes it (partition suite seeds 33 and 48). The mark and the CAS go to
    # Redis in that order (``Store.mark_then_transition``: one pipeline on one server, whose
    # commands Redis runs in order, so a CAS that ran had its mark written first; on a Redis
    # Cluster the mark first, then the script alone).
    mark = announce.entry(bid, gen, step, [ready])
    ok, info = await w.store.mark_then_transition(mark, bid, gen, step)
    await _announced(w, step, mark[1], ok, info, ready)


def ready_qualifier(bid: str, instances: list[str]) -> str:
    """'' for a block's first ready (its gang ``{bid}-{n}``); a victim of a preemption placed again
    in the same generation has other instance ids (``controller.on_allocation``), and its ready
    must not be taken for the first one's duplicate (docs/priority.md)."""
    if all(i.startswith(f"{bid}-") and i[len(bid) + 1:].isdigit() for i in instances):
        return ""
    return hashlib.sha1(",".join(sorted(instances)).encode()).hexdigest()[:8]


async def release(w: Worker, bid: str, iid: str, inst: InstanceRecord) -> None:
    """Give an instance's reservation back and forget it (idempotent)."""
    await w.store.release(inst["cluster"], inst["node"], iid)
    await w.store.drop_instance(bid, iid)
    await w.store.index_remove(uid(bid), uid(iid), iid)
    await w.hint(inst["cluster"], [inst["node"]])
