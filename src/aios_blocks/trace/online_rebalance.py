"""``blocks trace replay --online --in-process --rebalance``: the online replay (``trace/online.py``)
with the rebalancer (issue 38, docs/rebalance.md "Online replay"). Pure but for reading the CSV.

The walk and the preemption are the replay's own; the rebalancer comes in where the system has it:

* **before preemption**: a block the walk would preempt for first gets a ``builtin:rebalance-min``
  plan (at most ``max_moves`` moves, its input built by ``handlers.rebalance.rebalance_input``);
  when one makes room, its moves are applied and the block is placed, and nobody is preempted;
* **for the blocks that may not preempt** (priority 0, a waiting victim, the modes without
  preemption): after each walk, the head of the queue gets the same plans (at most ``MAX_PLANS``
  per capacity event), as the rebalancer worker's pending trigger does;
* **the worker's periodic round** (``frag_threshold`` given; ``replay`` gives the worker's
  defaults): at most every ``AIOS_REBALANCE_INTERVAL_S`` of the replay's clock, not within
  ``AIOS_REBALANCE_COOLDOWN_S`` of the round's last moves, the cluster's trigger is decided by
  ``handlers.rebalance.round_trigger`` (the worker's own decision) from the queue's head (and
  whether one of it has waited ``AIOS_REBALANCE_FRAG_WAIT_S``) and the cluster's FGD fragmentation ratio; a ``fragmentation`` round calls the policy with that trigger
  (pending blocks first, then moves that lower the fragmentation, at most ``frag_moves``).

A move is make-before-break: the moved task keeps running (no work lost, its departure unchanged),
on the move's target node and GPUs, from the instant it is decided (the new instance's start-up is
not modelled). The planner's "no plan" for a shape is kept until capacity changes, as the replay
keeps the preemption planner's.

Figures added to the replay's (``figures``): ``moves``, ``moves_per_placement``, ``alloc_last_third``
(the time-weighted GPU allocation % over the last third of the window) and the multi-GPU tasks'
wait p50/p99 (``multi_gpu_wait``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..handlers import preemption as pre
from ..handlers import rebalance as hr
from ..policies import capacity
from ..policies.builtin import preempt as bp
from ..policies.builtin import rebalance as rb
from ..policies.builtin.frag import Workload
from ..schemas.spec import Node
from . import online as on
from .online import CLUSTER, Job, Mode, Sim, Timed, release, shrink
from .replay import DEFAULT_POLICY, block_id

#: the rebalance plans one capacity event may ask for (like the preemption planner's budget)
MAX_PLANS = 4
#: the most moves per plan for a pending block (``AIOS_REBALANCE_MAX_MOVES``) and per fragmentation round
#: (``AIOS_REBALANCE_FRAG_MOVES``)
MAX_MOVES = rb.DEFAULT_MAX_MOVES
FRAG_MOVES = 2
#: the worker's round and cooldown (``AIOS_REBALANCE_INTERVAL_S``, ``AIOS_REBALANCE_COOLDOWN_S``)
INTERVAL_S = 10.0
COOLDOWN_S = 30.0
#: ``AIOS_REBALANCE_FRAG_THRESHOLD``, ``AIOS_REBALANCE_FRAG_WAIT_S``
FRAG_THRESHOLD = 0.1
FRAG_WAIT_S = 30.0


class MoveIndex:
    """The rebalance planner's input kept up to date as tasks are placed, leave and move, instead
    of rebuilt from every node view and every running task per plan (py-spy: most of a
    ``--rebalance`` replay went there), as ``handlers.preemption.Index`` does for the preemption
    planner. Holds what ``builtin:rebalance-min`` parses from ``handlers.rebalance.rebalance_input``:
    each node's ``_Node`` (and its FGD fragmentation on the replay's workload) and each running
    task's movable instances, in the order the old input listed them (the running tasks' order: a
    task keeps its place when it moves). It is a ``rb.Prepared``: ``plan(..., prepared=index)``
    gives the same moves as ``plan(rebalance_input(...))`` (tests/unit/test_online_rebalance_index.py)."""

    def __init__(self, views: dict[str, Any], shapes: list[dict[str, Any]]):
        self.wl = Workload([dict(s) for s in shapes])
        self.nodes: dict[str, bp._Node] = {}
        self.frags: dict[str, tuple[bp._Node, float]] = {}
        for nid in sorted(views):
            self.node(nid, views[nid])
        #: block id -> (priority, its movable instances, its budget of moves), in the running order
        self.rows: dict[str, tuple[int, list[rb.Inst], int]] = {}
        #: ``movable``'s answers since the rows last changed (the planner copies what it changes)
        self._movable: dict[int | None, tuple[list[rb.Inst], dict[str, int]]] = {}
        #: the planner's destinations per node state and instance shape, kept across plans (a node
        #: that changes gets a new ``_Node``: its entries are measured again)
        self.dest_cache = rb.DestCache()

    def node(self, nid: str, view: Any) -> None:
        """A node view changed: its planner shape and fragmentation again."""
        one = bp._nodes(pre.cluster_input(CLUSTER, {nid: view}))
        if nid not in one:
            self.nodes.pop(nid, None)
            self.frags.pop(nid, None)
            return
        if nid not in self.nodes and self.nodes and nid < next(reversed(self.nodes)):
            self.nodes = dict(sorted({**self.nodes, **one}.items()))  # keep the sorted order _nodes gives
        else:
            self.nodes[nid] = one[nid]
        n = self.nodes[nid]
        self.frags[nid] = (n, rb.Cluster({nid: n}, self.wl).frag(nid))

    def put(self, row: dict[str, Any]) -> None:
        """A running task (``Sim.row``) placed or moved (a moved one keeps its place in the order)."""
        bid = str(row["block_id"])
        self._movable.clear()
        rows = hr.movable([{**row, "status": "ready"}], self.nodes)
        insts, budget = rb.movable({"movable": rows}, None)
        if not rows:
            self.rows.pop(bid, None)
            return
        self.rows[bid] = (int(rows[0]["priority"]), insts, budget.get(bid, 0))

    def remove(self, bid: str) -> None:
        self._movable.clear()
        self.rows.pop(bid, None)

    def movable(self, ceiling: int | None) -> tuple[list[rb.Inst], dict[str, int]]:
        """``rb.movable`` of the input: the instances of the tasks at or below ``ceiling``."""
        if ceiling in self._movable:
            return self._movable[ceiling]
        insts: list[rb.Inst] = []
        budget: dict[str, int] = {}
        for bid, (prio, its, left) in self.rows.items():
            if (ceiling is not None and prio > ceiling) or left <= 0:
                continue
            budget[bid] = left
            insts.extend(its)
        self._movable[ceiling] = (insts, budget)
        return insts, budget


class RebalanceSim(Sim):
    def __init__(self, *args: Any, max_moves: int = MAX_MOVES, incremental_moves: bool = True,
                 frag_threshold: float | None = None, frag_moves: int | None = None, frag_idle: bool = False,
                 interval_s: float = INTERVAL_S, cooldown_s: float = COOLDOWN_S, frag_wait_s: float = FRAG_WAIT_S,
                 aged_plans: int = 0, age_s: float = 0.0, **kw: Any):
        super().__init__(*args, **kw)
        self.max_moves = max_moves
        #: plans per capacity event for the longest-waiting multi-GPU blocks (waited ``age_s`` at
        #: least), after the head's: blocks behind the head (lower priority) get room made too
        self.aged_plans, self.age_s = aged_plans, age_s
        self.aged_moves = 0
        #: the worker's periodic round (None: not modelled): its threshold, its moves per call,
        #: AIOS_REBALANCE_FRAG_IDLE, its interval and its cooldown
        self.frag_threshold, self.frag_idle = frag_threshold, frag_idle
        self.frag_moves = FRAG_MOVES if frag_moves is None else frag_moves
        self.interval_s, self.cooldown_s, self.frag_wait_s = interval_s, cooldown_s, frag_wait_s
        self.next_round, self.last_round_moves = 0.0, float("-inf")
        #: rounds by the trigger decided, and the moves of the fragmentation rounds
        self.rounds: dict[str, int] = {}
        self.frag_round_moves = 0
        #: ``incremental_moves``: the planner's input kept by ``MoveIndex`` (else rebuilt per plan)
        self.move_index = MoveIndex(self.views, self.st.shapes) if incremental_moves else None
        #: each move applied: (time, block, from, to, GPUs) (the comparison of old and new reads it)
        self.move_log: list[tuple[float, str, str, str, tuple[str, ...]]] = []
        self.moves = 0
        self.plans_with_moves = 0
        #: shapes (and priority) the planner found no moves for, until capacity changes
        self.no_moves: set[tuple[Any, int]] = set()
        #: bumped at each placement, departure and move (the cached rows are stale then)
        self.version = 0
        self._rows: tuple[int, int, list[tuple[int, dict[str, Any]]]] | None = None

    # -- the planner -----------------------------------------------------------------------------
    def placed_rows(self, floor: int) -> list[dict[str, Any]]:
        """The running tasks at or below ``floor`` as the planner's input reads them (the rows kept
        until a placement, a departure or a move changes them)."""
        if self._rows is None or self._rows[0] != len(self.running) or self._rows[1] != self.version:
            rows = [(int(r.ir["priority"]), {**self.row(b, r), "status": "ready"}) for b, r in self.running.items()
                    if r.place is not None]
            self._rows = (len(self.running), self.version, rows)
        return [row for prio, row in self._rows[2] if prio <= floor]

    def key(self, j: Job) -> tuple[Any, int]:
        t = j.timed.task
        return (capacity.shape(t.resources(), t.sharing), int(j.ir["priority"]))

    async def moves_for(self, j: Job, now: float) -> bool:
        """Apply the moves of a plan that lets ``j`` fit, then place it; False when there is none."""
        key = self.key(j)
        if key in self.no_moves or self.max_moves <= 0:
            return False
        if not self.room_somewhere(j):  # moves never make capacity: too little is free in all
            self.no_moves.add(key)
            return False
        bid = block_id(j.timed.task)
        block = self.block(j)
        if self.move_index is not None:  # the nodes and instances from the index: only the pending block to say
            data = {"action": "rebalance", "maxMoves": self.max_moves, "trigger": str(hr.Trigger.PENDING),
                    "pending": [pre.block_input(bid, j.ir)]}
            out = rb.plan(data, prepared=self.move_index)
        else:
            data = hr.rebalance_input(CLUSTER, self.views, self.placed_rows(int(j.ir["priority"])), [block], self.max_moves,
                                      hr.Trigger.PENDING, workload=self.st.shapes, measure=False)
            out = rb.plan(data)
        if not out["moves"] or out.get("for") != bid:
            self.no_moves.add(key)
            return False
        for m in out["moves"]:
            self.move_log.append((now, m["block_id"], m["from"], m["to"], tuple(m["to_gpus"])))
            self.move(m["block_id"], m["to"], list(m["to_gpus"]))
        self.plans_with_moves += 1
        if not await self.place(j, now):  # the plan said it fits; a resourceAllocator that refuses leaves it waiting
            return True
        return True

    def room_somewhere(self, j: Job) -> bool:
        """Whether the cluster has, over all its nodes, the GPU compute the task needs free (of a
        model it may use): moves never make capacity, so no plan exists otherwise (a cheap bound
        that spares building the planner's input)."""
        t = j.timed.task
        needs = t.resources()
        want = int(needs.get("gpus") or 0)
        if want <= 0:
            return True
        models = set(needs.get("gpuModels") or ())
        units = capacity.share_units(needs) if t.sharing else 0
        units = units if 0 < units < capacity.SHARE_UNITS else capacity.SHARE_UNITS
        free, need = 0, want * units
        for v in self.views.values():
            for g in v["gpus"]:
                if models and g.get("model") not in models:
                    continue
                left = 0 if g.get("exclusive") else int(g.get("share_free", capacity.SHARE_UNITS))
                if int(g.get("instances") or 0) == 0:
                    left = capacity.SHARE_UNITS
                free += left
                if free >= need:
                    return True
        return False

    def move(self, bid: str, to: str, gpus: list[str]) -> None:
        """A running task moved (make-before-break: it keeps running, its departure unchanged)."""
        j = self.running[bid]
        assert j.place is not None
        src, old = j.place
        t = j.timed.task
        self.views[src] = release(self.views[src], old, t.resources(), t.sharing)
        node = capacity.copy_node(self.views[to])
        capacity.take(node, gpus, t.resources(), t.sharing)
        self.views[to] = node
        j.place = (to, gpus)
        self.moves += 1
        self.version += 1
        self.changed()
        index = getattr(self, "index", None)  # the planner's incremental input, where the replay keeps one
        if index is not None:
            index.remove(bid)
            index.node(src, self.views[src])
            index.node(to, self.views[to])
            index.add(self.row(bid, j))
        if self.move_index is not None:
            self.move_index.node(src, self.views[src])
            self.move_index.node(to, self.views[to])
            self.move_index.put(self.row(bid, j))

    def changed(self) -> None:
        """Capacity moved: every "no" of the planners may be a "yes" now."""
        self.no_victims.clear()
        self.no_moves.clear()
        no_fit = getattr(self, "no_fit", None)
        if no_fit:
            no_fit.clear()

    def waiting(self) -> list[Job]:
        """The queue's head in its order (priority desc then age; FIFO: age), the blocks that fit no
        node now included (``head_entries`` passes over those when they may not preempt: moves may
        make room for them)."""
        if self.mode is Mode.FIFO:
            return sorted(self.pending.values(), key=lambda j: (j.since, block_id(j.timed.task)))[: self.head]
        return sorted(self.pending.values(), key=lambda j: (-int(j.ir["priority"]), j.since, block_id(j.timed.task)))[: self.head]

    # -- the hooks -------------------------------------------------------------------------------
    def unplace(self, bid: str) -> Job:
        self.no_moves.clear()
        self.version += 1
        place = self.running[bid].place
        nid = place[0] if place is not None else None
        j = super().unplace(bid)
        if self.move_index is not None and nid is not None:
            self.move_index.remove(bid)
            self.move_index.node(nid, self.views[nid])
        return j

    async def place(self, j: Job, now: float) -> bool:
        self.version += 1
        if not await super().place(j, now):
            return False
        if self.move_index is not None and j.place is not None:
            self.move_index.node(j.place[0], self.views[j.place[0]])
            self.move_index.put(self.row(block_id(j.timed.task), j))
        return True

    async def preempt(self, j: Job, now: float, key: tuple[Any, int] | None = None) -> bool:
        if await self.moves_for(j, now):  # moves before preemption
            return True
        return await super().preempt(j, now, key)

    async def drain(self, now: float) -> None:
        await self.drain_pending(now)
        if await self.worker_round(now):
            await self.drain_pending(now)

    async def drain_pending(self, now: float) -> None:
        await self.drain_head(now)
        if self.aged_plans > 0:
            await self.drain_aged(now)

    async def drain_aged(self, now: float) -> None:
        """Up to ``aged_plans`` plans for the multi-GPU blocks that have waited longest (at least
        ``age_s``), in the order they came, wherever they are in the queue."""
        aged = sorted((j for j in self.pending.values() if j.timed.task.num_gpu > 1 and now - j.since >= self.age_s),
                      key=lambda j: (j.since, block_id(j.timed.task)))
        plans = 0
        for j in aged:
            if plans >= self.aged_plans:
                return
            if self.key(j) in self.no_moves or block_id(j.timed.task) not in self.pending:
                continue
            plans += 1
            before = self.moves
            if await self.moves_for(j, now):
                self.aged_moves += self.moves - before
                await super().drain(now)

    async def drain_head(self, now: float) -> None:
        await super().drain(now)
        plans = 0
        while self.pending and plans < MAX_PLANS:
            done = False
            for j in self.waiting():
                if self.key(j) in self.no_moves:
                    continue
                plans += 1
                if await self.moves_for(j, now):
                    done = True
                    break
                if plans >= MAX_PLANS:
                    break
            if not done:
                return
            await super().drain(now)

    def frag_ratio(self) -> float:
        """The cluster's FGD fragmentation ratio (``handlers.rebalance.fragmentation``'s, on the
        replay's workload), from the index's per-node figures."""
        assert self.move_index is not None
        return sum(f for _, f in self.move_index.frags.values()) / self.cluster_milli

    async def worker_round(self, now: float) -> bool:
        """The rebalancer worker's periodic round (module docstring): whether it moved anything."""
        if self.frag_threshold is None or self.move_index is None or now < self.next_round:
            return False
        self.next_round = now + self.interval_s
        if now - self.last_round_moves < self.cooldown_s:
            self.rounds["cooldown"] = self.rounds.get("cooldown", 0) + 1
            return False
        head = self.waiting()
        waited = any(now - j.since >= self.frag_wait_s for j in head)
        kind, _why = hr.round_trigger(bool(head), self.frag_ratio(), self.frag_threshold, self.frag_idle, waited)
        self.rounds[str(kind or "skipped")] = self.rounds.get(str(kind or "skipped"), 0) + 1
        if kind is not hr.Trigger.FRAGMENTATION:
            return False  # ``pending``: the plans drain_pending asks for at each capacity event
        # the head's blocks the planner has no answer for since capacity last changed are left out
        # (the same "no" again); the worker's window is the head (at most MAX_PLANS of them)
        asks = [j for j in head if self.key(j) not in self.no_moves][:MAX_PLANS]
        data = {"action": "rebalance", "maxMoves": self.frag_moves, "trigger": str(kind),
                "pending": [pre.block_input(block_id(j.timed.task), j.ir) for j in asks]}
        out = rb.plan(data, prepared=self.move_index)
        if not out["moves"]:
            return False
        for m in out["moves"]:
            self.move_log.append((now, m["block_id"], m["from"], m["to"], tuple(m["to_gpus"])))
            self.move(m["block_id"], m["to"], list(m["to_gpus"]))
        if out.get("for"):
            self.plans_with_moves += 1
        else:
            self.frag_round_moves += len(out["moves"])
        self.last_round_moves = now
        return True


def last_third(sim: Sim) -> float:
    """The time-weighted GPU allocation % over the last third of the window (the series' steps)."""
    series = sim.res.series
    if not series or sim.span <= 0:
        return 0.0
    start, end = 2 * sim.span / 3, sim.span
    area, prev_t, prev_a = 0.0, start, None
    for t, a, _q in series:
        if t <= start:
            prev_a = a
            continue
        if t > end:
            break
        if prev_a is not None:
            area += (t - prev_t) * prev_a
        prev_t, prev_a = t, a
    if prev_a is not None:
        area += (end - prev_t) * prev_a
    return area / (end - start)


def multi_gpu_waits(sim: Sim) -> list[float]:
    """Each multi-GPU task's wait (arrival to first placement; never placed: to the window's end)."""
    out = []
    for j in sim.jobs.values():
        if j.timed.task.num_gpu > 1:
            out.append(j.first_wait if j.first_wait is not None else max(0.0, sim.last_t - j.timed.created))
    return out


def figures(sim: Sim) -> dict[str, Any]:
    """The replay's figures plus the rebalancer's (see the module's docstring)."""
    def pct(xs: list[float], q: float) -> float:
        s = sorted(xs)
        return round(s[min(len(s) - 1, int(len(s) * q))], 3) if s else 0.0

    d = sim.res.as_dict()
    moves = int(getattr(sim, "moves", 0))
    waits = multi_gpu_waits(sim)
    if isinstance(sim, RebalanceSim):
        d.update({"rounds": dict(sim.rounds), "frag_round_moves": sim.frag_round_moves})
    d.update({"rebalance": isinstance(sim, RebalanceSim), "moves": moves,
              "moves_per_placement": round(moves / sim.res.placed, 4) if sim.res.placed else 0.0,
              "alloc_last_third": round(last_third(sim), 3),
              "multi_gpu_wait": {"n": len(waits), "p50": pct(waits, 0.5), "p99": pct(waits, 0.99)}})
    if d["rebalance"]:
        d["mode"] = f"{d['mode']}+rebalance"
    return d


async def replay(nodes: list[Node], timed: list[Timed], mode: Mode = Mode.PREEMPTION, policy: str = DEFAULT_POLICY,
                 seed: int = 42, sample_nodes: int = 0, workload: str = "", drawn: int = 0, load: float = 1.0,
                 cluster_share: float = 1.0, rebalance: bool = True, max_moves: int = MAX_MOVES,
                 frag_threshold: float | None = FRAG_THRESHOLD) -> dict[str, Any]:
    """One online replay, with the rebalancer or without (the same figures for both);
    ``frag_threshold``: the worker's periodic round with that threshold (None: not modelled)."""
    nodes = shrink(nodes, cluster_share, seed)
    if load != 1.0:
        timed = [replace(t, created=t.created / load) for t in timed]
    args = (nodes, timed, mode, policy, seed, sample_nodes, on.HEAD, on.MIN_DELTA, workload)
    sim = RebalanceSim(*args, max_moves=max_moves, frag_threshold=frag_threshold) if rebalance else Sim(*args)
    sim.res.drawn_times, sim.res.load, sim.res.cluster_share = drawn, load, cluster_share
    await sim.run()
    return figures(sim)
