"""The distributed rig of the partition suite and the soak: a 3-server NATS cluster whose routes
and client connections all go through cuttable links (``integration.links.PartitionedNats``),
the ``AIOS`` stream and key bucket replicated three ways (``AIOS_STREAM_REPLICAS=3``), a 6-node
Redis Cluster (3 primaries, 3 replicas), and the system's normal workers (the runtime's
``Supervisor``) pointed at both through ``AIOS_NATS_URL``/``AIOS_REDIS_URL``-style URLs.

The faults (each a method): cut the stream leader off from the other servers and from every
client, then heal; SIGKILL a Redis primary (its replica is promoted), then start it again (it
rejoins as a replica); SIGKILL a worker (the supervisor starts another); SIGSTOP a NATS server
past its timeouts, then SIGCONT. The checks: ``blocks check --json`` as a separate process, then
``blocks recover --force`` and the digest compared with the one before."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from aios_blocks.bus import subjects
from aios_blocks.cli.client import Client
from aios_blocks.recovery.invariants import Report
from aios_blocks.recovery.invariants import check as run_check
from aios_blocks.runtime.supervisor import Supervisor

from ..integration.cluster_servers import RedisCluster
from ..integration.conftest import COMPONENT
from ..integration.links import PartitionedNats

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = {"parser": 1, "gateway": 2, "controller": 2, "agent-sim": 1}
#: how much longer than asked a partition stays cut while the majority has not named a leader yet
LEADER_WAIT_S = 30.0
#: how long a partition stays cut at least after the majority named its leader: time for a create
#: sent during the cut to be acknowledged by it (the probe's publish waits 2 s a try), so that the
#: majority's availability is measured, not skipped (a cut healed 1 s after the election had no
#: create acknowledged in it: seed 3)
AFTER_LEADER_S = 5.0
#: the settled check's word for a ready block below its minInstances (an instance lost, no
#: replacement placed yet)
SHORT = re.compile(r"block (\S+): ready with \d+ running instances < minInstances \d+")
#: after the recover, how many tries (2 s apart) a short block gets to come back by itself: past
#: the reconciler's longest backoff (AIOS_RECONCILE_MAX_BACKOFF_S, 60 s) between its asks
SHORT_ATTEMPTS = 45
#: `blocks recover --force` runs again while it answers "try again" (JetStream not available yet)
RECOVER_TRIES = 5


@dataclass
class Rig:
    data: Path
    layout: dict[str, int] = field(default_factory=lambda: dict(LAYOUT))
    nats: PartitionedNats = field(init=False)
    redis: RedisCluster = field(init=False)
    sup: Supervisor = field(init=False)
    client: Client = field(init=False)
    log: list[str] = field(default_factory=list)
    #: each ``cli`` call: its arguments, exit status and seconds (where a schedule's checks spend time)
    cli_log: list[str] = field(default_factory=list)

    async def start(self) -> Rig:
        """(``AIOS_STREAM_REPLICAS=3`` must be in the environment: the workers inherit it.)"""
        self.nats = PartitionedNats(self.data / "nats").start()
        try:
            self.redis = RedisCluster(self.data / "redis").start()
        except BaseException:
            self.nats.stop()
            raise
        self.sup = Supervisor(self.nats.url, self.redis.url, layout=dict(self.layout), log_dir=str(self.data / "logs")).start()
        try:
            self.client = await open_client(self.nats.url, self.redis.url)
            await self.client.add_component(COMPONENT)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        if hasattr(self, "client"):
            await self.client.close()
        self.sup.stop()
        for proc in self.nats.procs.values():  # a server left stopped would not terminate
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        self.nats.stop()
        self.redis.stop()

    def note(self, what: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {what}")

    # -- faults ------------------------------------------------------------------------------------
    async def leader(self, stream: str = subjects.STREAM) -> str:
        """The server leading ``stream`` (asked of whichever server the client is on)."""
        for _ in range(60):
            try:
                info = await asyncio.wait_for(self.client.bus.js.stream_info(stream), 2.0)
                if info.cluster is not None and info.cluster.leader:
                    return str(info.cluster.leader)
            except Exception:
                pass
            await asyncio.sleep(0.5)
        raise AssertionError(f"no leader of {stream}")

    async def partition_leader(self, seconds: float, stream: str = subjects.STREAM,
                               probe: Probe | None = None) -> dict[str, float]:
        """Cut the leader of ``stream`` off from the other servers and every client for
        ``seconds`` (at least ``AFTER_LEADER_S`` past the new leader), then heal. Figures:
        ``leader_s``, until the majority named another leader; ``acked_in_cut``, creates sent and
        acknowledged while cut;
        with ``probe``: ``placed_s``, until a create published after the cut was ready (the
        pause in placements a minority partition causes)."""
        old = await self.leader(stream)
        t0 = time.monotonic()
        self.nats.isolate(old)
        self.note(f"isolate {old} (leader of {stream})")
        figures: dict[str, float] = {"cut_at": t0}
        if probe is not None:
            probe.mark(t0)
        # the cut lasts ``seconds``, longer while no other leader is seen (a wait: an election
        # takes more than the shortest cut on a loaded machine, and the figure is what is measured)
        while time.monotonic() - t0 < (max(seconds, figures["leader_s"] + AFTER_LEADER_S) if "leader_s" in figures
                                       else seconds + LEADER_WAIT_S):
            if "leader_s" not in figures:
                try:
                    info = await asyncio.wait_for(self.client.bus.js.stream_info(stream), 1.0)
                    if info.cluster and info.cluster.leader and info.cluster.leader != old:
                        figures["leader_s"] = time.monotonic() - t0
                except Exception:
                    pass
            await asyncio.sleep(0.2)
        # creates sent and acknowledged during the cut (the majority alone): one of them is placed, still cut
        figures["acked_in_cut"] = sum(t >= t0 for t in probe.acked.values()) if probe is not None else 0
        if probe is not None and figures["acked_in_cut"]:
            await probe.placed_after_mark(timeout=60)
            if probe.first_ready_after_mark is not None:
                figures["placed_s"] = probe.first_ready_after_mark - t0
        self.nats.heal()
        self.note(f"heal {old} after {time.monotonic() - t0:.1f}s")
        return figures

    async def redis_failover(self, rng: random.Random) -> int:
        """SIGKILL a Redis primary; wait for its replica's promotion (every live node says
        ``cluster_state:ok``); start the killed node again; wait until all six say ok."""
        port = rng.choice(await asyncio.to_thread(self.redis.primaries))
        self.redis.kill(port)
        t0 = time.monotonic()
        self.note(f"redis kill {port}")
        await asyncio.to_thread(self.redis.wait_promoted, port, 60.0)
        self.note(f"redis replica promoted in {time.monotonic() - t0:.1f}s")
        await asyncio.to_thread(self.redis.wait_ok, 60.0)
        self.redis.restart(port)
        await asyncio.to_thread(self.redis.wait_ok, 60.0)
        self.note(f"redis back {port} as {await asyncio.to_thread(self.redis.role, port)}")
        return port

    def kill_worker(self, rng: random.Random) -> str:
        kind = rng.choice(sorted(self.layout))
        pids = self.sup.pids(kind)
        if not pids:
            return ""
        os.kill(rng.choice(pids), signal.SIGKILL)
        self.note(f"kill -9 {kind}")
        return kind

    async def pause_server(self, name: str, seconds: float) -> None:
        """SIGSTOP server ``name`` for ``seconds`` (past the 2 s route pings and the Raft
        election timeout), then SIGCONT."""
        pid = self.nats.procs[name].pid
        os.kill(pid, signal.SIGSTOP)
        self.note(f"SIGSTOP {name}")
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
            self.note(f"SIGCONT {name}")

    # -- checks ------------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        return {**os.environ, "AIOS_NATS_URL": self.nats.url, "AIOS_REDIS_URL": self.redis.url}

    async def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        t0 = time.monotonic()
        r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "aios_blocks.cli", *args], env=self.env(),
                                    capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        self.cli_log.append(f"{' '.join(args[:2])} rc={r.returncode} {time.monotonic() - t0:.1f}s")
        return r

    async def blocks_check(self, settled: bool = True, attempts: int = 30) -> dict[str, Any]:
        """``blocks check --json`` until it holds (bounded: blocks may still be settling); the
        last report, with ``rc``."""
        rep: dict[str, Any] = {}
        for attempt in range(attempts):
            # while blocks settle, the same check in this process (no interpreter to start each
            # time: 4-7 s at load 25); the verdict is always the separate ``blocks check``'s
            if attempt < attempts - 1 and not (await self._check_here(settled)):
                await asyncio.sleep(2.0)
                continue
            r = await self.cli("check", "--json", "--settled" if settled else "--live")
            try:
                rep = {**json.loads(r.stdout), "rc": r.returncode}
            except json.JSONDecodeError:
                rep = {"rc": r.returncode, "violations": [r.stdout[-2000:] + r.stderr[-2000:]]}
            if r.returncode == 0:
                return rep
            await asyncio.sleep(2.0)
        return rep

    async def _check_here(self, settled: bool) -> bool:
        """``recovery.invariants.check`` (what ``blocks check`` runs) on the test's client: holds?"""
        rep = await self._report_here(settled)
        return rep is not None and rep.ok

    async def _report_here(self, settled: bool = True) -> Report | None:
        """The report of ``recovery.invariants.check`` (what ``blocks check`` runs) on the test's
        client; None while a server is still coming back."""
        try:
            return await asyncio.wait_for(run_check(self.client.bus, self.client.store, settled=settled), 120)
        except Exception:
            return None

    async def settle(self, tolerated: Callable[[str], bool], attempts: int = 20) -> dict[str, Any]:
        """The settled check in this process, retried (2 s apart, bounded) while blocks settle,
        until no violation is left but ``tolerated`` ones: its last report (``as_dict``, with
        ``rc``)."""
        rep: dict[str, Any] = {"rc": 2, "violations": ["the invariant check could not reach the servers"]}
        for attempt in range(attempts):
            got = await self._report_here()
            if got is not None:
                rep = {**got.as_dict(), "rc": 0 if got.ok else 1}
                if all(tolerated(v) for v in got.violations):
                    return rep
            if attempt < attempts - 1:
                await asyncio.sleep(2.0)
        return rep

    async def final_checks(self, clusters: list[str]) -> tuple[list[str], dict[str, Any]]:
        """After healing: the settled check (``recovery.invariants.check``, retried while blocks
        settle), ``blocks recover --force``, ``blocks check --json`` (a separate process: every
        invariant, Redis digest = stream digest among them), the GPU holders. Returns the
        violations and the figures. A Redis digest that differs from the stream's *before* the
        recover is a violation unless a Redis primary was killed in this run (Redis replicates
        asynchronously: a write its primary acknowledged just before SIGKILL can be lost;
        ``blocks recover`` is the repair) and nothing else was violated; the keys that differed
        are in the figures.

        (The check before the recover runs here, not as ``blocks check``: the same function on the
        same servers, without an interpreter started for each try: each ``blocks`` process took
        50-58 s at load 35, four of them per schedule.)"""
        failed_over = any(" redis kill " in f" {line} " for line in self.log)

        def tolerated(v: str) -> bool:
            return failed_over and v.startswith("Redis state differs")

        before = await self.settle(tolerated, attempts=20)
        differs = [v for v in before.get("violations", []) if v.startswith("Redis state differs")]
        violations = [v for v in before.get("violations", []) if v not in differs]
        if differs and not failed_over:
            violations += differs + [f"  {d}" for d in before.get("diff", [])[:20]]
        for _ in range(RECOVER_TRIES):  # as a user does when the command says "try again" (JetStream's
            r = await self.cli("recover", "--force")  # meta group still electing after a heal: seed 67)
            if r.returncode == 0 or "try again" not in r.stdout + r.stderr:
                break
            await asyncio.sleep(3.0)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        after = await self.blocks_check(settled=True, attempts=5)
        after, short, freed = await self._short_come_back(after)
        redis_after, stream_after = after.get("redis_digest", ""), after.get("stream_digest", "")
        if not redis_after or redis_after != stream_after:
            violations.append(f"after blocks recover: Redis digest {redis_after} != stream digest {stream_after}")
        if after["rc"] != 0:
            violations += [f"after recover: {v}" for v in after.get("violations", [])[:20]]
        holders = await self.gpu_holders(clusters)
        violations += [f"GPU {k} held by {v}" for k, v in list(holders.items())[:20]]
        figures = {"check_before_recover": before["rc"], "diverged_before_recover": before.get("diff", []) if differs else [],
                   "digest_before": before.get("redis_digest"), "digest_after": redis_after,
                   "counts": after.get("counts") or before.get("counts"),
                   "short_after_recover": short, "deleted_for_room": freed}
        return violations, figures

    async def _short_come_back(self, after: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
        """Blocks ``ready`` below their ``minInstances`` after the recover (an instance lost with
        the simulated agent, its replacement refused: "no healthy node can host", the burst having
        filled the cluster; seeds 64 and 94) are not settled, and not lost either: the reconciler
        asks for them until there is room. The check proves that: first they get time to come
        back by themselves (room that exists is taken within the reconciler's longest backoff);
        then the ready blocks holding the most GPUs in their clusters are deleted until those cover
        what the short ones miss, and every block must settle. Returns the last report, the short
        blocks and the deleted ones (nothing is tolerated: a block still short is a violation)."""
        def short_only(rep: dict[str, Any]) -> list[str]:
            found = [SHORT.match(v) for v in rep.get("violations", [])]
            return [m.group(1) for m in found if m] if rep["rc"] != 0 and found and all(found) else []

        short = short_only(after)
        if not short:
            return after, [], []
        self.note(f"after recover: {len(short)} ready blocks short of minInstances: {short}")
        after = await self.blocks_check(settled=True, attempts=SHORT_ATTEMPTS)
        still = short_only(after)
        if not still:
            return after, short, []
        freed = await self._room_for(still)
        self.note(f"deleted {freed} for room: {still} still short after {SHORT_ATTEMPTS} tries")
        return await self.blocks_check(settled=True, attempts=SHORT_ATTEMPTS), short, freed

    async def _room_for(self, short: list[str]) -> list[str]:
        """Delete the ready blocks holding the most GPUs in the short blocks' clusters until their
        GPUs cover what the short ones miss; the ids deleted."""
        need: dict[str, int] = {}
        for bid in short:
            b, insts = await self.client.store.block_view(bid)
            if b is not None:
                running = sum(1 for i in insts.values() if i.get("status") == "running")
                missing = max(int(b["ir"].get("minInstances", 1)) - running, 0)
                need[b["cluster"]] = need.get(b["cluster"], 0) + missing * max(int(b["ir"]["resources"].get("gpus", 1)), 1)
        held: list[tuple[int, str, str]] = []
        for bid in await self.client.store.list_blocks(limit=100_000):
            b, insts = await self.client.store.block_view(bid) if bid not in short else (None, {})
            if b is not None and b.get("status") == "ready" and b.get("cluster") in need:
                held.append((len(insts) * int(b["ir"]["resources"].get("gpus", 1)), bid, b["cluster"]))
        deleted: list[str] = []
        for gpus, bid, cid in sorted(held, reverse=True):
            if need[cid] > 0 and gpus > 0:
                await self.client.delete(bid)
                need[cid] -= gpus
                deleted.append(bid)
        return deleted

    async def gpu_holders(self, clusters: list[str]) -> dict[tuple[str, str, str], list[str]]:
        """Each (cluster, node, GPU) with more than one reservation holding it (exclusive
        one-GPU instances: must be empty)."""
        holders: dict[tuple[str, str, str], list[str]] = {}
        for cid in clusters:
            for r in await self.client.store.reservations(cid):
                for g in msgspec.json.decode(r["gpus"]):
                    holders.setdefault((cid, r["node"], g), []).append(r["iid"])
        return {k: v for k, v in holders.items() if len(v) > 1}


@dataclass
class Probe:
    """Creates published one after another, each retried (same message id) until acknowledged,
    and a watcher that notes when each is first seen ready in Redis: the pause a partition
    causes in placements is read off these."""

    client: Client
    body: dict[str, Any]
    prefix: str
    acked: dict[str, float] = field(default_factory=dict)
    ready: dict[str, float] = field(default_factory=dict)
    mark_at: float | None = None
    first_ready_after_mark: float | None = None
    n: int = 0

    def mark(self, t: float) -> None:
        self.mark_at, self.first_ready_after_mark = t, None

    async def publish(self, bid: str, body: dict[str, Any], deadline_s: float = 120) -> float:
        start = time.monotonic()
        payload = msgspec.json.encode({**body, "blockId": bid})
        while True:
            try:
                await asyncio.wait_for(self.client.bus.publish_raw(f"aios.block.{bid}.create", payload, msg_id=f"create:{bid}"), 2.0)
                break
            except Exception:
                if time.monotonic() - start > deadline_s:
                    raise
                await asyncio.sleep(0.2)
        self.acked[bid] = start  # when it was sent (acknowledged by now)
        return start

    async def run(self, count: int, every_s: float, until: asyncio.Event | None = None) -> None:
        """``count`` creates, ``every_s`` apart; with ``until``: at least ``count``, and on until
        it is set."""
        watcher = asyncio.create_task(self._watch())
        try:
            while self.n < count or (until is not None and not until.is_set()):
                self.n += 1
                await self.publish(f"{self.prefix}-{self.n}", self.body)
                await asyncio.sleep(every_s)
        finally:
            watcher.cancel()

    async def _watch(self) -> None:
        while True:
            await self.poll_ready()
            await asyncio.sleep(0.1)

    async def poll_ready(self) -> None:
        todo = [b for b in self.acked if b not in self.ready]
        if not todo:
            return
        try:
            pipe = self.client.store.r.pipeline(transaction=False)
            for bid in todo:
                pipe.hget(f"aios:block:{bid}", "status")
            got = await pipe.execute()
        except Exception:  # Redis failing over: poll again
            return
        now = time.monotonic()
        for bid, st in zip(todo, got, strict=True):
            if st == "ready":
                self.ready[bid] = now
                if self.mark_at is not None and self.first_ready_after_mark is None and self.acked[bid] >= self.mark_at:
                    self.first_ready_after_mark = now

    def latency(self) -> float:
        """The median time from sent to seen ready (what a create takes here with no fault)."""
        took = sorted(self.ready[b] - self.acked[b] for b in self.ready)
        return took[len(took) // 2] if took else float("nan")

    async def placed_after_mark(self, timeout: float) -> None:
        """Until a create sent after the mark is ready (bounded)."""
        deadline = time.monotonic() + timeout
        while self.first_ready_after_mark is None and time.monotonic() < deadline:
            await self.poll_ready()
            await asyncio.sleep(0.1)


async def open_client(nats_url: str, redis_url: str, attempts: int = 60) -> Client:
    """The JetStream meta group elects its leader a moment after the servers start."""
    for n in range(attempts):
        try:
            return await Client.open(nats_url, redis_url)
        except Exception:
            if n == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")
