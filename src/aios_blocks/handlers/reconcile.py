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

**Short blocks.** A ``ready`` block still short at a pass after the reconciler's first ask
(the ask placed nothing: no node could take it) is *short*, a condition beside its status
(``schemas.condition``): :func:`decide` says when to set the record's mark and announce it
(``block.degraded``, once per spell), when to update the mark silently (fewer or more live, a new
reason: the latest failed ``scale``/``reassignment`` step of the block the controller noted,
:class:`Note`), and when to clear it (``block.restored`` once it is whole again; silently when it
left ``ready``). Whether a spell was announced is the memory's ``degraded`` or the mark itself, so
a lost memory or a lost mark (``blocks recover``) does not announce it twice.

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

from ..schemas.condition import BlockShort
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
    #: the record's short mark (``schemas.condition``), None when it has none
    short: BlockShort | None = None


@dataclass(frozen=True)
class Note:
    """A ``scale`` or ``reassignment`` step of the block that failed, as the controller noted it
    (``state.reconcile``): the reason a short block's mark gives."""

    gen: int
    step: str
    reason: str
    at: float


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
    #: its ``block.degraded`` was published (the spell is announced)
    degraded: bool = False


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
    #: ``block.degraded`` to publish (a spell begins) and ``block.restored`` (whole again)
    degraded: list[BlockShort] = field(default_factory=list)
    restored: list[BlockShort] = field(default_factory=list)
    #: bid -> the mark to write on its record (new or changed); (bid, gen) whose mark goes
    marks: dict[str, BlockShort] = field(default_factory=dict)
    unmark: list[tuple[str, int]] = field(default_factory=list)


def request_id(bid: str, gen: int, mem: Memory) -> str:
    """Deterministic in the memory: a copy that takes over from the same memory asks with the same
    id (the stream drops the repeat), a new attempt gets a new one."""
    return f"reconcile-{gen}-{int(mem.since * 1000)}-{mem.attempts}"


def episode(since: float) -> str:
    """A short spell's id (its start in ms): both of its events' ids name it."""
    return str(int(since * 1000))


def decide(blocks: Iterable[BlockSize], memory: Mapping[str, Memory], now: float, backoff: Backoff,
           notes: Mapping[str, Note] | None = None, note_window_s: float = 5.0) -> Outcome:
    """One pass over every block. A ``ready`` block with fewer live instances than
    ``minInstances`` gets an :class:`Ask` for ``max(minInstances, desired)`` (clamped to
    ``maxInstances``) unless its backoff runs; the memory of every other block (not short, not
    ready, not in ``blocks``: gone) is dropped. The short condition (module doc): ``notes``, bid ->
    the block's latest failed step; one of this generation at most ``note_window_s`` older than
    the spell is its reason."""
    out = Outcome([], {}, [], {})
    for b in blocks:
        if b.status != BlockStatus.READY or not b.cluster:
            if b.short is not None:  # left ready (deleted, preempted...): its own steps say so
                out.unmark.append((b.block_id, b.gen))
            continue
        live = scaling.live(b.instances)
        before = memory.get(b.block_id)
        running = sum(1 for rec in live.values() if rec.get("status") == "running")
        if len(live) >= b.min_instances:
            _whole(b, before, len(live), running, now, out)
            continue
        mem, target = _ask(b, before, len(live), running, now, backoff, out)
        note = (notes or {}).get(b.block_id)
        if note is not None and (note.gen != b.gen or note.at < mem.since - note_window_s):
            note = None
        out.memory[b.block_id] = _short(b, before, mem, len(live), running, target, note, out)
    out.dropped.extend(sorted(bid for bid in memory if bid not in out.memory))
    return out


def _ask(b: BlockSize, before: Memory | None, live: int, running: int, now: float, backoff: Backoff, out: Outcome
         ) -> tuple[Memory, int]:
    """The ask for a short block's missing instances, unless its backoff runs: the memory after it."""
    mem = before or Memory(since=now)
    what = f"{live} live ({running} running) < minInstances {b.min_instances}"
    target, _ = scaling.clamp(max(b.min_instances, b.desired), b.min_instances, b.max_instances)
    if now < mem.next_at:
        out.short[b.block_id] = f"{what}; next ask in {mem.next_at - now:.1f} s (attempt {mem.attempts})"
        return mem, target
    mem = replace(mem, attempts=mem.attempts + 1)
    delay = backoff.delay(mem.attempts)
    mem = replace(mem, next_at=now + delay, request_id=request_id(b.block_id, b.gen, mem))
    reason = (f"{what} for {now - mem.since:.0f} s: asking for {target} (attempt {mem.attempts}; "
              f"again in {delay:g} s while short)")
    out.asks.append(Ask(b.block_id, b.gen, target, mem.request_id, reason))
    out.short[b.block_id] = reason
    return mem, target


def _short(b: BlockSize, before: Memory | None, mem: Memory, live: int, running: int, target: int, note: Note | None,
           out: Outcome) -> Memory:
    """The condition of a block short now: announced once its earlier ask placed nothing (a pass
    after the first ask finds it still short), its mark kept up to date silently after that."""
    announced = b.short is not None or (before is not None and before.degraded)
    if not announced and (before is None or before.attempts < 1):
        return mem  # not asked yet, or asked in this very pass: the ask may still place it
    since = b.short.since if b.short is not None else mem.since
    why = (f"{note.step} failed: {note.reason}" if note is not None
           else f"the reconciler's ask for {target} placed nothing yet (attempt {mem.attempts})")
    mark = BlockShort(b.block_id, b.gen, live, running, b.min_instances, since, why, episode(since))
    if not announced:
        out.degraded.append(mark)
    if mark != b.short:
        out.marks[b.block_id] = mark
    return replace(mem, degraded=True)


def _whole(b: BlockSize, before: Memory | None, live: int, running: int, now: float, out: Outcome) -> None:
    """A ready block with its minimum: a spell announced (its mark, or the memory's word) ends."""
    if b.short is None and (before is None or not before.degraded):
        return
    since = b.short.since if b.short is not None else before.since if before is not None else now
    out.restored.append(BlockShort(b.block_id, b.gen, live, running, b.min_instances, since,
                                   f"{live} live >= minInstances {b.min_instances} after {now - since:.0f} s short",
                                   episode(since)))
    out.unmark.append((b.block_id, b.gen))


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
