"""The health checker (``blocks worker checker``, started by ``blocks up``; docs/health.md).

Every ``health_interval_s``, for each block whose lease it holds (``state.health``: one checker
copy decides a block at a time, a copy takes over when the lease lapses):

1. **active**: ``GET {endpoint}/health`` of each ``ready`` instance with a short time limit
   (``health_probe_timeout_s``); the SDK and the simulated instances answer it on their event
   loop, never behind a task (docs/health.md);
2. **passive** and **progress**: the executors' per-instance counts (errors, timeouts, ejections,
   task latency, in-flight and how long without a completion; ``executor.outlier``), and the
   metrics collector's latest sample;
3. runs the block's ``stabilityChecker`` policy (the instance map carries it; default
   ``builtin:probe-threshold``) with
   ``action: "health_check"``, checks its answer (``handlers.stability.validate``: a policy that
   raises, times out or answers garbage fails the tick, nothing changes, and the reason is
   recorded as ``block.health.failed``, at most once a minute per reason);
4. publishes the verdicts that change something (``handlers.stability.decide``: startup grace,
   the max(1, 10 %) out-of-routing cap) as ``block.instance.verdict``: the mapper sets the
   instance's routing (``health``, ``weight``), the controller restarts it (``node.instance.restart``)
   or replaces it (the resourceAllocator's ``reassignment``).

5. marks the nodes whose every probed instance fails, while their agent is silent, **suspect**
   (``state.health``; decided by ``handlers.reconcile.suspicion``): no placement goes there until
   a probe passes or the agent beats again (docs/health.md "Suspect nodes").

The probe record, restart counts and cooldowns live in the deciding copy's memory: a copy that
takes a block over starts them afresh (a few more probes before a verdict).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import time

import aiohttp
import structlog

from ..bus.catalog import E
from ..bus.instance_map import InstanceMaps
from ..executor.outlier import max_out
from ..handlers import reconcile as rc
from ..handlers import stability as st
from ..runtime.ticker import Ticker
from ..schemas.errors import PolicyFailed
from ..schemas.events import InstanceVerdict, StepFailed
from ..schemas.policy_io import as_float
from ..schemas.protocol import HEALTH_PATH, INSTANCE_HEADER, MISDIRECTED
from ..schemas.records import BlockMap, JSONObject, MapEntry, wire
from .base import Worker

log = structlog.get_logger("aios.checker")

DEFAULT_RULE = {"name": "stabilityChecker", "policyRuleURI": "builtin:probe-threshold"}
CONCURRENCY = 256


class Checker:
    def __init__(self, w: Worker):
        self.w, self.s = w, w.settings
        self.holder = f"checker-{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.maps: dict[str, BlockMap] = {}
        self.probes: dict[str, st.ProbeRecord] = {}
        self.restarts: dict[str, int] = {}
        #: iid -> when its last restart/replace was ordered
        self.busy: dict[str, float] = {}
        self.session: aiohttp.ClientSession | None = None
        self._sem = asyncio.Semaphore(CONCURRENCY)
        self.ticks = 0
        #: bid -> the last tick's outcome ("ok" or the failure), for tests and `blocks explain`
        self.last: dict[str, str] = {}
        #: (node, iid, consecutive failures, ok, error) of each instance probed this tick
        self._probed: list[tuple[str, str, int, bool, str]] = []
        #: nodes this copy marked suspect (their marks are renewed or cleared by it)
        self.suspect: set[str] = set()

    async def on_map(self, bid: str, value: BlockMap | None, rev: int) -> None:
        if value is None:
            self.maps.pop(bid, None)
        else:
            self.maps[bid] = value

    # -- probes ----------------------------------------------------------------------------------
    async def probe(self, endpoint: str, path: str = HEALTH_PATH, iid: str = "") -> tuple[bool, float, int, str]:
        """One probe; ``iid``: the instance meant (``Aios-Instance``: one now at a reused port answers 421)."""
        assert self.session is not None
        t0 = time.perf_counter()
        async with self._sem:
            try:
                async with self.session.get(endpoint + path, headers={INSTANCE_HEADER: iid} if iid else None,
                                            timeout=aiohttp.ClientTimeout(total=self.s.health_probe_timeout_s)) as r:
                    await r.read()
                    return r.status == 200, time.perf_counter() - t0, r.status, "" if r.status == 200 else f"HTTP {r.status}"
            except TimeoutError:
                return False, time.perf_counter() - t0, 0, f"probe timed out after {self.s.health_probe_timeout_s:g} s"
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                return False, time.perf_counter() - t0, 0, f"{type(exc).__name__}: {exc}"

    # -- one block ---------------------------------------------------------------------------------
    async def check(self, bid: str, m: BlockMap) -> list[st.Action]:
        """One tick of one block; the verdicts carried out."""
        now = time.time()
        insts: dict[str, MapEntry] = m.get("instances") or {}
        gen = int(m.get("gen", 0))
        rule = dict(m.get("stabilityChecker") or DEFAULT_RULE)  # the mapper copies it from the block
        settings = rule.get("settings") or {}
        await self._probe_all(insts, settings, now)
        passive = await self.w.store.health.passive(bid, max(5.0, self.s.outlier_publish_s * 10))
        try:
            metrics = await self.w.store.metrics.instances(bid)
        except Exception:
            metrics = {}
        rule.setdefault("name", "stabilityChecker")
        rule.setdefault("policyRuleURI", DEFAULT_RULE["policyRuleURI"])
        grace = self._grace(settings)
        inputs = [st.instance_input(iid, r, now, self.probes.get(iid), passive.get(iid, []), self.restarts.get(iid, 0),
                                    metrics.get(iid)) for iid, r in insts.items()]
        routed = sum(1 for r in insts.values() if r.get("state") == "ready")
        data = st.payload(bid, inputs, grace, max_out(routed, self.s.health_max_out_ratio))
        rule_id = f"{bid}.stabilityChecker"
        try:
            ctx = None if str(rule["policyRuleURI"]).startswith("builtin:") else await self.w.store.context_load(rule_id)
            result = await self.w.runtime.invoke(rule, rule_id, wire(data), ctx)
            verdicts = st.validate(result, inputs)
        except (PolicyFailed, st.BadVerdicts) as exc:
            reason = exc.reason if isinstance(exc, PolicyFailed) else f"stabilityChecker {rule['policyRuleURI']}: {exc}"
            await self.failed(bid, gen, reason)
            return []
        self.last[bid] = "ok"
        actions, held = st.decide(inputs, verdicts, grace, self.s.health_max_out_ratio, self.busy, now,
                                  cooldown_s=max(grace, 5.0) * 2)
        for note in held:
            log.info("checker.held", block=bid, note=note)
        seq = str(int(now * 1000))
        for a in actions:
            await self.w.bus.emit(E.instance_verdict, InstanceVerdict(bid, gen, a.instance_id, a.node_id, a.verdict, a.reason,
                                                                      a.weight, str(rule["policyRuleURI"]), seq))
            log.info("checker.verdict", block=bid, instance=a.instance_id, verdict=a.verdict, reason=a.reason)
            self._carried_out(a, now)
        return actions

    async def _probe_all(self, insts: dict[str, MapEntry], settings: JSONObject, now: float) -> None:
        """Probe the block's routed instances (rule settings the checker itself reads: ``probe``,
        false: no active probe, only passive and progress signals; ``probePath``, default the
        instance protocol's /health) and keep each result in its record."""
        path = str(settings.get("probePath") or HEALTH_PATH)
        probed = {iid: r for iid, r in insts.items() if r.get("state") == "ready" and r.get("endpoint")}
        if settings.get("probe") is False:
            probed = {}
        results = await asyncio.gather(*(self.probe(r["endpoint"], path, iid) for iid, r in probed.items()))
        for iid, (ok, lat, status, err) in zip(probed, results, strict=True):
            if status == MISDIRECTED:  # another instance answers at its address: the map is behind, no reading
                log.info("checker.misdirected", instance=iid, endpoint=probed[iid].get("endpoint"), error=err)
                continue
            rec = self.probes.setdefault(iid, st.ProbeRecord())
            rec.observe(ok, lat, status, err, now)
            self._probed.append((str(probed[iid].get("node", "")), iid, rec.consecutive_failures, ok, err))

    def _grace(self, settings: JSONObject) -> float:
        """The rule's ``startupGraceS``, else AIOS_HEALTH_STARTUP_GRACE_S."""
        try:
            return as_float(settings.get("startupGraceS", self.s.health_startup_grace_s))
        except (TypeError, ValueError):
            return self.s.health_startup_grace_s

    def _carried_out(self, a: st.Action, now: float) -> None:
        """A restarted or replaced instance: busy for a while, probed afresh, its restarts counted."""
        if a.verdict in ("restart", "replace"):
            self.busy[a.instance_id] = now
            self.probes.pop(a.instance_id, None)  # a fresh record for the restarted instance
            if a.verdict == "restart":
                self.restarts[a.instance_id] = self.restarts.get(a.instance_id, 0) + 1

    async def suspects(self) -> None:
        """Mark, renew or clear suspect nodes from this tick's probes (``handlers.reconcile.suspicion``)."""
        rows, self._probed = self._probed, []
        nodes = sorted({r[0] for r in rows if r[0]} | self.suspect)
        if not nodes:
            return
        beats = await self.w.store.health.last_heartbeats(nodes)
        verdict = rc.suspicion(rows, beats, time.time(), self.s.node_suspect_failures, self.s.node_suspect_silence_s,
                               self.suspect)
        for nid in await self.w.store.health.mark_suspect(verdict.mark, self.s.node_suspect_ttl_s):
            log.warning("node.suspect", node=nid, reason=verdict.mark[nid])
        for nid in await self.w.store.health.clear_suspect(verdict.clear):
            log.info("node.suspect_cleared", node=nid)
        self.suspect = (self.suspect | set(verdict.mark)) - set(verdict.clear)

    async def failed(self, bid: str, gen: int, reason: str) -> None:
        """A failed tick: nothing changed; the reason is recorded (rate-limited per reason)."""
        self.last[bid] = reason
        log.warning("checker.tick_failed", block=bid, reason=reason)
        key = hashlib.sha1(reason.encode()).hexdigest()[:12]
        period = self.s.health_failure_record_s
        if await self.w.store.health.should_record(bid, key, period):
            rid = f"{key}:{int(time.time() // period)}"
            await self.w.bus.emit(E.block_health_failed, StepFailed(bid, gen, "health_check", reason[:2000], rid))

    # -- the loop ----------------------------------------------------------------------------------
    async def tick(self) -> None:
        maps = dict(self.maps)
        mine = []
        for bid in maps:
            if await self.w.store.health.lead(bid, self.holder, self.s.health_lease_s):
                mine.append(bid)
        results = await asyncio.gather(*(self.check(bid, maps[bid]) for bid in mine), return_exceptions=True)
        for bid, r in zip(mine, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("checker.block_failed", block=bid, error=repr(r))
        try:
            await self.suspects()
        except Exception as exc:  # Redis away: the marks lapse or wait for the next tick
            log.warning("checker.suspects_failed", error=repr(exc))
        live = {iid for m in maps.values() for iid in (m.get("instances") or {})}
        for d in (self.probes, self.restarts, self.busy):
            for iid in [i for i in d if i not in live]:
                del d[iid]
        self.ticks += 1

    async def loop(self, stop: asyncio.Event) -> None:
        await Ticker(self.s.health_interval_s, "checker.tick_failed", log).run(self.tick, stop)

    async def run(self, stop: asyncio.Event) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))
        ready = asyncio.Event()
        watch = asyncio.get_running_loop().create_task(InstanceMaps(self.w.bus, create=False).watch(self.on_map, stop, ready))
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), 10)
            log.info("checker.running", blocks=len(self.maps), interval_s=self.s.health_interval_s)
            await self.loop(stop)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch
            await self.session.close()


async def run(w: Worker, stop: asyncio.Event) -> None:
    await Checker(w).run(stop)
