"""The reconciler's decisions and the node-suspicion rule: pure functions (docs/reliability.md,
"Reconciler"; docs/health.md, "Suspect nodes").

**Reconciler.** Edge-triggered steps (a reassignment after a fault or an eviction, a scale step)
can fail for good: a failed reassignment is final. The reconciler is level-triggered, the way
Kubernetes controllers are: on every relevant change and on a slow resync it compares, for every
``ready`` block, the instances that count (starting or running: ``scaling.live``) with
``minInstances`` and, while it is short, asks for the missing ones with the existing action, a
``block.scale.target`` (source ``reconciler``, the reason in words), so the ask and the step's
failure (``block.scale.failed``, with why no node could take it) are stored events that
``blocks replay`` and ``blocks explain`` show. Asks for one block are spaced by an exponential
backoff (``base``, doubled per attempt up to ``cap``) kept in :class:`Memory`, which the worker
stores in Redis: a copy that takes the lease over goes on from it, and asks with the same
request id (deduplicated by the stream) rather than a new one. Instances on a dead node still
count: moving them is the eviction's job; once it released them they no longer count.

**Announcements.** A status step's events not yet acked by the stream (``state.announce``) are
published again when they have waited ``after_s`` and their block holds the step's target now (same
generation); dropped when it does not (the block moved on or is gone: its later steps say so).

**Suspect nodes.** A node whose every probed instance has failed ``threshold`` probes in a row, and
whose agent has been silent a while, is suspect before its heartbeat times out: no placement goes
there. One passing probe on it, or its agent beating again, clears the mark.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..schemas.lifecycle import BlockStatus
from ..schemas.records import InstanceRecord
from . import scaling

SOURCE = "reconciler"


@dataclass(frozen=True)
class BlockSize:
    """What the reconciler reads of one block: its record's sizes and its instances' statuses."""

    block_id: str
    gen: int
    status: str
    cluster: str
    min_instances: int
    max_instances: int
    #: the block's stored target (``desired``; 0: none)
    desired: int = 0
    #: iid -> {status, node, ...} (the instance records)
    instances: dict[str, InstanceRecord] = field(default_factory=dict)


@dataclass(frozen=True)
class Memory:
    """The reconciler's memory of one block while it is short (dropped once it is not)."""

    #: when it was first seen short
    since: float
    #: asks made since then
    attempts: int = 0
    #: no new ask before this
    next_at: float = 0.0
    #: the last ask's request id
    request_id: str = ""


@dataclass(frozen=True)
class Ask:
    """Ask for ``target`` instances of the block (a ``block.scale.target``, source ``reconciler``)."""

    block_id: str
    gen: int
    target: int
    request_id: str
    reason: str


@dataclass(frozen=True)
class Backoff:
    base_s: float = 2.0
    cap_s: float = 60.0

    def delay(self, attempts: int) -> float:
        """The wait after the ``attempts``-th ask: base, 2 x base, 4 x base ... at most cap."""
        return min(self.base_s * 2 ** max(0, min(attempts - 1, 30)), self.cap_s)


@dataclass(frozen=True)
class Outcome:
    asks: list[Ask]
    #: the memory of every block still short (what the worker stores)
    memory: dict[str, Memory]
    #: blocks whose memory is dropped (no longer short, gone, not ready)
    dropped: list[str]
    #: bid -> why it is short now and what was done (logs, status)
    short: dict[str, str]


def request_id(bid: str, gen: int, mem: Memory) -> str:
    """Deterministic in the memory: a copy that takes over from the same memory asks with the same
    id (the stream drops the repeat), a new attempt gets a new one."""
    return f"reconcile-{gen}-{int(mem.since * 1000)}-{mem.attempts}"


def decide(blocks: Iterable[BlockSize], memory: Mapping[str, Memory], now: float, backoff: Backoff) -> Outcome:
    """One pass over every block. A ``ready`` block with fewer live instances than
    ``minInstances`` gets an :class:`Ask` for ``max(minInstances, desired)`` (clamped to
    ``maxInstances``) unless its backoff runs; the memory of every other block (not short, not
    ready, not in ``blocks``: gone) is dropped."""
    asks: list[Ask] = []
    out: dict[str, Memory] = {}
    short: dict[str, str] = {}
    for b in blocks:
        live = scaling.live(b.instances)
        if b.status != BlockStatus.READY or not b.cluster or len(live) >= b.min_instances:
            continue
        running = sum(1 for rec in live.values() if rec.get("status") == "running")
        mem = memory.get(b.block_id) or Memory(since=now)
        what = f"{len(live)} live ({running} running) < minInstances {b.min_instances}"
        if now < mem.next_at:
            out[b.block_id] = mem
            short[b.block_id] = f"{what}; next ask in {mem.next_at - now:.1f} s (attempt {mem.attempts})"
            continue
        target, _ = scaling.clamp(max(b.min_instances, b.desired), b.min_instances, b.max_instances)
        mem = replace(mem, attempts=mem.attempts + 1)
        delay = backoff.delay(mem.attempts)
        mem = replace(mem, next_at=now + delay, request_id=request_id(b.block_id, b.gen, mem))
        reason = (f"{what} for {now - mem.since:.0f} s: asking for {target} (attempt {mem.attempts}; "
                  f"again in {delay:g} s while short)")
        asks.append(Ask(b.block_id, b.gen, target, mem.request_id, reason))
        out[b.block_id] = mem
        short[b.block_id] = reason
    return Outcome(asks, out, sorted(bid for bid in memory if bid not in out), short)


# -- announcements not acked ------------------------------------------------------------------------
class Unannounced(Protocol):
    """A status step's announcement the stream has not acked (``state.announce.Pending``)."""

    @property
    def key(self) -> str: ...
    @property
    def block_id(self) -> str: ...
    @property
    def gen(self) -> int: ...
    @property
    def target(self) -> str: ...
    @property
    def at(self) -> float: ...


def announcements(pending: Iterable[Unannounced], now_status: Mapping[str, tuple[str, int]], now: float, after_s: float
                  ) -> tuple[list[str], list[str]]:
    """(keys to publish again, keys to drop). ``now_status``: bid -> (status, gen) as read now
    (absent: no such block). One that has waited ``after_s`` is published again while its block
    holds the step's target in the same generation (the step was taken, the stream may not know);
    otherwise it is dropped (the CAS did not take, or the block moved on: its later steps are
    announced by their own). A younger one is left to its publisher."""
    again: list[str] = []
    drop: list[str] = []
    for p in pending:
        if now - p.at < after_s:
            continue
        status, gen = now_status.get(p.block_id, ("", -1))
        (again if status == p.target and gen == p.gen else drop).append(p.key)
    return again, drop


# -- suspect nodes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Suspicion:
    #: node -> why it is suspect now
    mark: dict[str, str]
    #: nodes with a passing probe or a fresh heartbeat: their mark (if any) goes
    clear: list[str]


def suspicion(
    probed: Iterable[tuple[str, str, int, bool, str]], last_beat: Mapping[str, float | None], now: float,
    threshold: int, silence_s: float, marked: Iterable[str] = (),
) -> Suspicion:
    """``probed``: (node, instance, consecutive failures, last probe ok, last error) of each
    instance probed this round; ``last_beat``: when each node's agent last sent a heartbeat (None:
    never). A node is suspect when it has a probed instance, every one of them has failed
    ``threshold`` probes in a row, and its agent has been silent ``silence_s`` (an instance that
    crashed on a node whose agent still beats says nothing about the node; a node that never
    sends heartbeats cannot be judged). A node with a passing probe is cleared, and so is one of
    ``marked`` whose agent beats again."""
    per: dict[str, list[tuple[str, int, bool, str]]] = {}
    for node, iid, fails, ok, error in probed:
        if node:
            per.setdefault(node, []).append((iid, fails, ok, error))
    mark: dict[str, str] = {}
    clear: set[str] = set()
    for node in sorted(per):
        rows = per[node]
        beat = last_beat.get(node)
        if any(ok for _, _, ok, _ in rows):
            clear.add(node)
        elif all(fails >= threshold for _, fails, _, _ in rows) and beat is not None and now - beat >= silence_s:
            iid, fails, _, error = min(rows, key=lambda r: r[1])
            mark[node] = (f"all {len(rows)} probed instance(s) on it fail their health probes ({fails}+ in a row, "
                          f"{iid}: {error or 'failed'}) and no heartbeat for {now - beat:.1f} s")
    for node in marked:
        beat = last_beat.get(node)
        if node not in mark and beat is not None and now - beat < silence_s:
            clear.add(node)
    return Suspicion(mark, sorted(clear))
