"""The one adapter that commits effects (``handlers/effects.py``) to Redis and NATS, in order.
Every effect is idempotent, so a redelivered message whose decision is re-run and re-committed
changes nothing twice (the stream deduplicates the events by their catalog id rule)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

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
from ..schemas.events import BlockStatus, ReassignRequest
from ..schemas.lifecycle import TRANSITIONS, InstanceStatus, Step
from .base import Worker


async def commit(w: Worker, effects: Iterable[Effect]) -> None:
    #: a block's instances as read atomically with this commit's last write (``SetInstance``):
    #: a guard right after it needs no read of its own
    fresh: list[tuple[str, Mapping[str, dict[str, Any]]]] = []
    for effect in effects:
        if not await _one(w, effect, fresh):
            return  # a guard failed (the instance is gone): the rest depended on it


async def _one(w: Worker, e: Effect, fresh: list[tuple[str, Mapping[str, dict[str, Any]]]]) -> bool:
    seen = fresh.pop() if fresh else None  # good for the effect right after the write only
    match e:
        case Publish(events):
            await w.bus.emit_all(events)
            if seen is not None:
                fresh.append(seen)  # publishing changes no state
        case SetInstance(bid, iid, status, endpoint):
            rec, insts = await w.store.set_instance_status_all(bid, iid, status.value, endpoint)
            if rec is None:
                return False
            fresh.append((bid, insts))
        case Transition(bid, gen, step, fields, then, redo):
            kw: dict[str, Any] = dict(fields)
            ok, info = await w.store.transition(bid, gen, step, **kw)
            if ok or (redo and info == TRANSITIONS[step].target):
                await commit(w, then)
        case Release(bid, iid, inst):
            await release(w, bid, iid, inst)
        case ReadyIfRunning(bid, gen, needed, cid, step):
            insts = seen[1] if seen is not None and seen[0] == bid else await w.store.instances(bid)
            if sum(1 for i in insts.values() if i["status"] == InstanceStatus.RUNNING) >= needed:
                await _ready(w, bid, gen, cid, step, sorted(insts))
        case DeletedIfEmpty(bid, gen):
            # read after our own drop: two removals handled at once must not each still see the
            # other's instance (then neither would mark the block deleted)
            if not await w.store.instances(bid):
                deleted = BlockStatus(bid, gen, "deleted")
                await commit(w, [Transition(bid, gen, Step.DELETED, then=(Publish((Emit(E.block_deleted, deleted),)),))])
        case RemoveAll(bid, gen, reason):
            for iid, rec in (await w.store.instances(bid)).items():
                await w.store.set_instance_status(bid, iid, InstanceStatus.REMOVING.value)
                await w.bus.emit_all([remove_command(bid, gen, rec["cluster"], iid, rec["node"], reason)])
        case Replace(bid, gen, cid, iid, reason, request_id, avoid):
            req = ReassignRequest(bid, cid, request_id, iid, reason, gen=gen, avoid_node=avoid, at=round(time.time(), 3))
            ack = await w.bus.emit(E.cluster_reassignment, req, sync=True)
            if not getattr(ack, "duplicate", False):
                # counted once per request, as the stream holds it once (a redelivered fault is
                # deduplicated; recover counts the stored requests): the limit is not reached early
                await w.store.block_bump(bid, "replacements")
        case _:
            raise TypeError(f"unknown effect {e!r}")
    return True


async def _ready(w: Worker, bid: str, gen: int, cid: str, step: Step, instances: list[str]) -> None:
    ok, info = await w.store.transition(bid, gen, step)
    if ok or info == TRANSITIONS[step].target:  # a redelivery after the CAS re-publishes (deduplicated)
        await w.bus.emit(E.block_ready, BlockStatus(bid, gen, "ready", "", cid, instances))


async def release(w: Worker, bid: str, iid: str, inst: dict[str, Any]) -> None:
    """Give an instance's reservation back and forget it (idempotent)."""
    await w.store.release(inst["cluster"], inst["node"], iid)
    await w.store.drop_instance(bid, iid)
    await w.store.index_remove(uid(bid), uid(iid), iid)
    await w.hint(inst["cluster"], [inst["node"]])
