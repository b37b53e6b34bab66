"""Node liveness, served by every controller process (many copies share the work):

* heartbeats (core NATS, queue group: each beat reaches one controller) are batched into
  ``aios:heartbeats`` once a second; a beat from a node marked unhealthy marks it healthy again;
* a sweep finds nodes whose last beat is older than ``AIOS_NODE_TIMEOUT_S``: the controller whose
  compare-and-set flips the node to unhealthy (exactly one) publishes ``aios.node.{nid}.health``
  and asks for a ``reassignment`` of each instance on it; the reassignment releases the dead
  node's reservations and queues a remove in its mailbox, so a node that returns stops the old
  copies and each instance id runs once;
* ``aios.node.{nid}.expected`` requests (an agent reconciling after a restart) are answered with
  the instances the state has on that node.

Stream messages replayed onto these core subjects (an observer may point an ephemeral push
consumer at any subject the stream does not capture) always carry a ``$JS.ACK.`` reply subject:
real heartbeats carry none and real requests reply to the agent's inbox, so such messages are
dropped (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, TypedDict

import msgspec
import structlog

from ..bus import subjects
from ..bus.catalog import E
from ..bus.nats_bus import may_reply
from ..runtime.ticker import Ticker
from ..schemas.events import Heartbeat, NodeHealth, ReassignRequest
from ..schemas.records import InstanceRecord, MetricsTarget
from .base import Worker

log = structlog.get_logger("aios.health")

FLUSH_S = 1.0


class ExpectedReply(TypedDict, total=False):
    """The answer to a node agent's ``node.expected`` request: the instances the state has on its
    node (their block, generation and status), or why they could not be read."""

    instances: dict[str, InstanceRecord]
    error: str


class HealthMonitor:
    def __init__(self, w: Worker, timeout_s: float | None = None):
        self.w = w
        self.timeout_s = w.settings.node_timeout_s if timeout_s is None else timeout_s
        self._seen: dict[str, tuple[str, float]] = {}
        self._metrics: dict[str, MetricsTarget] = {}
        self._registered: dict[str, tuple[str, float]] = {}  # node -> (its agent's metrics URL, when registered)

    async def run(self, stop: asyncio.Event) -> None:
        nc = self.w.bus.nc
        subs = [
            await nc.subscribe(subjects.HEARTBEAT_ALL, queue="aios-health", cb=self._on_heartbeat, pending_msgs_limit=1_000_000),
            await nc.subscribe(subjects.EXPECTED_ALL, queue="aios-controller", cb=self._on_expected),
        ]
        sweep_every = max(0.2, min(self.timeout_s / 4, 5.0))
        next_sweep = time.monotonic() + sweep_every

        async def round_() -> None:
            """The heartbeats seen go to Redis; every ``sweep_every``, silent nodes are marked."""
            nonlocal next_sweep
            await self.flush()
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + sweep_every
                await self.sweep()

        # Redis/NATS trouble: try again next round; one last round once stopped (the last heartbeats)
        ticker = Ticker(FLUSH_S, "health.round_failed", log, wait_first=True)
        try:
            await ticker.run(round_, stop)
            try:
                await round_()
            except Exception as exc:
                log.warning("health.round_failed", error=repr(exc))
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _on_heartbeat(self, msg: Any) -> None:
        if msg.reply:  # agents publish heartbeats plainly: this is a replayed stream message
            log.debug("heartbeat.dropped", subject=msg.subject, why="has a reply subject")
            return
        try:
            hb = msgspec.json.decode(msg.data, type=Heartbeat)
        except msgspec.MsgspecError:
            return
        self._seen[hb.node_id] = (hb.cluster_id, time.time())
        if hb.metrics:  # the agent's own /metrics: a target as the workers' (blocks prometheus-config, the collector's http_sd)
            self._metrics[hb.node_id] = {"id": f"agent-{hb.node_id}", "kind": "agent", "kinds": ["agent"],
                                         "cluster": hb.cluster_id, "url": hb.metrics}

    async def _on_expected(self, msg: Any) -> None:
        if not msg.reply or not may_reply(msg.reply):
            # a replayed stream message ($JS. reply), not an agent asking; or a request naming a
            # subject that is no inbox, which the answer would forge (bus.nats_bus.may_reply)
            level = log.debug if not msg.reply or msg.reply.startswith("$JS.") else log.warning
            level("expected.ignored", subject=msg.subject, reply=(msg.reply or "")[:120])
            return
        nid = msg.subject.split(".")[2]
        body: ExpectedReply
        try:
            insts = await self.w.store.node_instances(nid)
            body = {"instances": {
                iid: {"block_id": i["block_id"], "gen": i["gen"], "status": i.get("status", "")} for iid, i in insts.items()
            }}
        except Exception as exc:
            body = {"error": repr(exc)}
        with contextlib.suppress(Exception):
            await msg.respond(msgspec.json.encode(body))

    async def flush(self) -> None:
        targets, self._metrics = self._metrics, {}
        ttl, now = self.w.settings.metrics_target_ttl_s, time.monotonic()
        for nid, target in targets.items():  # refreshed every ttl/3; lapses once its agent falls silent
            if self._registered.get(nid, ("", 0.0))[0] != target["url"] or now - self._registered[nid][1] >= ttl / 3:
                await self.w.store.metrics.register_target(target, ttl)
                self._registered[nid] = (target["url"], now)
        seen, self._seen = self._seen, {}
        if not seen:
            return
        await self.w.store.heartbeats_record({nid: ts for nid, (_, ts) in seen.items()})
        pairs = [(cid, nid) for nid, (cid, _) in seen.items()]
        for (cid, nid), healthy in zip(pairs, await self.w.store.nodes_healthy(pairs), strict=True):
            if healthy is False and await self.w.store.set_node_health_cas(cid, nid, True):
                await self.w.store.health.clear_suspect([nid])  # back: its instances are probed afresh
                await self._announce(NodeHealth(nid, cid, True, "heartbeats resumed"))
                await self.w.hint(cid, [nid])

    async def sweep(self) -> None:
        now = time.time()
        for nid in await self.w.store.heartbeats_overdue(now - self.timeout_s):
            meta = await self.w.store.node_meta(nid)
            if meta is None:
                await self.w.store.heartbeats_forget(nid)
                continue
            cid = meta["cluster"]
            if not meta["healthy"] or not await self.w.store.set_node_health_cas(cid, nid, False):
                continue
            await self.w.hint(cid, [nid])
            insts = await self.w.store.node_instances(nid)
            reason = f"node {nid} unhealthy: no heartbeat for {self.timeout_s:g}s"
            log.warning("node.unhealthy", node=nid, instances=len(insts))
            await self._announce(NodeHealth(nid, cid, False, reason, sorted(insts)))
            stamp = int(now)
            for iid, inst in insts.items():
                bid = inst["block_id"]
                request_id = f"{iid}:evicted:{stamp}"
                await self.w.bus.emit(E.cluster_reassignment, ReassignRequest(
                    bid, inst["cluster"], request_id, iid, reason, gen=int(inst["gen"]), avoid_node=nid, at=round(now, 3)))

    async def _announce(self, ev: NodeHealth) -> None:
        state = "healthy" if ev.healthy else "unhealthy"
        await self.w.bus.emit(E.node_health, ev, qualifier=f"{state}:{int(time.time())}")
