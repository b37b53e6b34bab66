"""``builtin:fgd-plus``: fragmentation gradient descent with a look-ahead measure that sees the
GPUs a node's CPUs (and memory) will strand, best fit where that measure ties. docs/trace.md
"Our policy: builtin:fgd-plus".

FGD (``builtin:fgd``, Weng et al., USENIX ATC '23) places a task where the node's fragmentation
grows least: the free GPU compute a task drawn from the target workload could not use there,
asking only whether *one* such task fits. A node with 8 free GPUs and CPUs left for 3 tasks is
not fragmented for FGD; 5 of its GPUs will never be used. On the Alibaba trace most GPUs left
idle are stranded that way (failures "GPU and CPU/memory free on different nodes"). Changes:

1. **Look-ahead measure.** :class:`FillWorkload`: for each shape of the workload, the node's
   free GPU compute that shape could not use if the node were filled with it, counting how many
   fit by GPU (whole-GPU slots, or shares per GPU) *and* by CPU. The policy descends a blend,
   ``(1 - lookAhead)`` x FGD's measure + ``lookAhead`` x this one (``parameters.lookAhead``,
   default 0.2: FGD's one-task view still steers multi-GPU work; 0.2 beat 0.3 on default and multigpu40).
2. **Memory strands GPUs too.** The CPU in both measures is the node's *effective* CPU: the
   fewer of its free CPUs and its free memory over the workload's memory per CPU
   (``parameters.memoryPerCpu`` MiB, else the shapes' own ``memory``, else the request's ratio).
3. **Best fit on ties.** Equal changes (idle nodes alike, nodes with no free GPU for a CPU-only
   task) go to the node left with the least free GPU compute, then the least effective CPU; a
   CPU-only task among those to the node with the most CPU per free GPU left. A shared task goes
   to the GPU whose use grows the measure least, then the fullest that fits.
4. **Models the constrained work needs.** A task that may use any model (or several) pays, on a
   node of model M, the GPU compute it takes times M's *pressure*: the workload's GPU demand that
   only some models may serve, split over them by supply, as a share of all demand, over M's
   share of the cluster's GPUs (capped at 1), times ``parameters.modelPressure`` (default 0.5;
   0: off). On gpuspec33 T4-only tasks ask more GPUs than the cluster's T4s: unconstrained work
   there is work they lose. No constrained shape: no change.
5. **Shares packed by their prices.** A shared task adds, per GPU, ``parameters.sharePacking``
   (default 10; 0: off) x 1000 x what the share *loses* there by the cutting-stock dual prices
   of the workload's share sizes (``share_prices.SharePrices``): 0 where it takes its part of one
   of the best ways to fill that GPU, more where it spoils the GPU for the shares that would fill
   it (a 0.32 on a GPU holding a 0.47). Uses the share sizes' frequencies, not the tasks to come.
   On the trace the GPUs left idle at 100 % arrived are the free parts of shared GPUs.
6. **Share space needs CPUs.** What a share leaves on its GPU is worth only what the share sizes
   the node's CPUs can still take fill, and what the GPU had free only what the sizes its CPUs
   could take before fill (``parameters.shareCpu``, default 2; 1: the space left only; each
   size's CPUs: its fewest among the workload's shapes), and any task pays ``parameters.leftoverCpu`` (default 1) x
   1000 x the worth its CPUs take from the node's partly used GPUs (a CPU-only task that leaves
   4 CPUs where a 0.53 waits for a 0.47 asking 8). Uses the shapes' CPUs, not the tasks to come.
7. **The multi-GPU shapes FGD's cut leaves out.** ``parameters.workload`` is FGD's target workload,
   the most frequent shapes up to 95 % of the tasks: on the default trace that drops every task
   of 2, 4 and 8 GPUs (0.9 % of the tasks, 7 % of the GPU requests), so neither measure keeps a
   node for them and they fail while GPUs are idle elsewhere. ``parameters.multiGpu`` (the
   replay passes them: ``trace.workload.multi_gpu_shapes``) joins both measures at
   ``parameters.multiGpuWeight`` (default 0.5; 0: off) x their frequencies.
8. **Nodes only the large shapes fit** (opt-in). A shape of the workload (with the ``multiGpu``
   ones) that only a few nodes can hold at all, by their size (GPUs, CPUs, memory, model: at most
   ``parameters.hostShare`` of the cluster's GPUs, default 0.1; the 8-GPU tasks asking 120 CPUs
   fit only 128-CPU nodes), puts its demand on those nodes: per node class (GPU model and count)
   its *host pressure*, that demand split over the classes holding the shape by their GPUs, as
   a share of all GPU demand, over the class's share of the cluster's GPUs (capped at 1), as
   4. does for models. A task pays ``parameters.hostPressure`` (default 0: off) x that pressure
   x what it takes there (its GPU compute, or its CPUs counted in GPUs at the class's CPUs per GPU,
   the larger): work that fits elsewhere leaves those nodes to the shapes only they hold. A task
   only such nodes fit pays alike on each. docs/rebalance.md "Keeping the few large nodes".

Same feasibility as every built-in (``capacity.node_fits``), ranked through the same per-shape
index as the baselines (``_FragBase``); remaining ties by the seeded hash of the node id, so a
run is deterministic per seed. Stateless.
"""

from __future__ import annotations

import zlib
from typing import Any

from ...schemas.records import GpuView, Needs, NodeView
from .. import capacity
from .frag import UNITS, Workload, _FragBase, gpu_left, node_model, share_options
from .share_prices import SharePrices

#: digits the fragmentation change is rounded to before the pack tie-break applies (the measure
#: is in thousandths of a GPU, weighted by frequencies: 1e-6 is far below one task's effect)
DIGITS = 6
#: the weight of the look-ahead (fill) measure against FGD's (``parameters.lookAhead``)
LOOK_AHEAD = 0.2
#: the weight of the per-model pressure of model-constrained demand (``parameters.modelPressure``)
MODEL_PRESSURE = 0.5
#: the weight, in thousandths per GPU lost, of a share's packing loss (``parameters.sharePacking``)
SHARE_PACKING = 10.0
#: how the share prices see the node's CPUs (``parameters.shareCpu``): 0 not at all, 1 the free
#: compute a share leaves is worth what the sizes the node's CPUs can still take fill, 2 (the
#: default) also what the GPU had free (by the CPUs before): a share is not charged for space
#: the node's CPUs had already left to no size
SHARE_CPU = 2
#: the weight, in thousandths per GPU, of the share space a task's CPUs leave no size to fill on
#: its node's partly used GPUs (``parameters.leftoverCpu``; 0: off)
LEFTOVER_CPU = 1.0
#: the factor on the frequencies of the multi-GPU shapes FGD's 95 % cut leaves out
#: (``parameters.multiGpu``) when they join the measure (``parameters.multiGpuWeight``; 0: off)
MULTI_GPU_WEIGHT = 0.5
#: the weight of the host pressure of the shapes only a few nodes fit (``parameters.hostPressure``; 0: off)
HOST_PRESSURE = 0.0
#: a shape only nodes with at most this share of the cluster's GPUs can hold is scarce (``parameters.hostShare``)
HOST_SHARE = 0.1


def node_class(node: NodeView) -> tuple[str, int]:
    """What the host pressure is kept per: the node's GPU model and count (read from its state)."""
    return node_model(node), len(node.get("gpus") or ())


def holds(node: NodeView, gpus: int, cpu: float, memory: float, models: Any) -> bool:
    """Whether the node, empty, could hold a task of ``gpus`` GPUs (0: CPU only; a share counts
    as 1), ``cpu`` CPUs and ``memory`` MiB on one of ``models`` (empty: any)."""
    return (len(node.get("gpus") or ()) >= gpus and float(node.get("cpu", 0) or 0) + 1e-9 >= cpu
            and float(node.get("memory", 0) or 0) >= memory and (not gpus or not models or node_model(node) in models))


def _gpu_demand(shape: dict[str, Any]) -> float:
    """A target shape's GPU demand: its frequency x GPUs (x its share of one GPU); 0 for a
    shape of no weight or no GPU."""
    w, gpus = float(shape.get("weight", 0) or 0), int(shape.get("gpus", 0) or 0)
    if w <= 0 or not gpus:
        return 0.0
    part = float(shape.get("gpuShare") or 0)
    return w * gpus * (part if 0 < part < 1 else 1.0)


def _class_supply(nodes: list[NodeView]) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], float]]:
    """Per node class (:func:`node_class`) of the GPU nodes: its GPUs and its CPUs."""
    supply: dict[tuple[str, int], int] = {}
    cpus: dict[tuple[str, int], float] = {}
    for n in nodes:
        if n.get("gpus"):
            c = node_class(n)
            supply[c] = supply.get(c, 0) + len(n["gpus"])
            cpus[c] = cpus.get(c, 0.0) + float(n.get("cpu", 0) or 0)
    return supply, cpus


def _hosts(shape: dict[str, Any], nodes: list[NodeView]) -> list[NodeView]:
    """The GPU nodes that, empty, could hold the shape (:func:`holds`)."""
    gpus, cpu, mem = int(shape.get("gpus", 0) or 0), float(shape.get("cpu", 0) or 0), float(shape.get("memory", 0) or 0)
    models = set(shape.get("gpuModels") or ())
    return [n for n in nodes if n.get("gpus") and holds(n, gpus, cpu, mem, models)]


def host_pressure(shapes: list[dict[str, Any]], nodes: list[NodeView],
                  share: float) -> dict[tuple[str, int], tuple[float, float]]:
    """The shapes only a few nodes can hold (rule 8): per node class (:func:`node_class`) that
    holds one, (its host pressure, its CPUs per GPU). A shape is scarce when the nodes that could
    hold it empty (GPUs, CPUs, memory, model) have at most ``share`` of the cluster's GPUs; its GPU
    demand (frequency x GPUs) is split over those nodes' classes by their GPUs; a class's pressure
    is that demand as a share of all the shapes' GPU demand, over the class's share of the
    cluster's GPUs, capped at 1."""
    supply, cpus = _class_supply(nodes)
    total = sum(supply.values())
    demand = 0.0
    held: dict[tuple[str, int], float] = {}
    for s in shapes:
        d = _gpu_demand(s)
        if not d:
            continue
        demand += d
        hosts = _hosts(s, nodes)
        able = sum(len(n["gpus"]) for n in hosts)
        if not able or able > share * total:
            continue
        for n in hosts:
            held[node_class(n)] = held.get(node_class(n), 0.0) + d * len(n["gpus"]) / able
    if demand <= 0 or total <= 0:
        return {}
    return {c: (min(1.0, (h / demand) / (supply[c] / total)), cpus[c] / supply[c]) for c, h in held.items() if h > 0}


def model_pressure(shapes: list[dict[str, Any]], supply: dict[str, int]) -> dict[str, float]:
    """Per GPU model, the workload's GPU demand that only a subset of models may serve (split
    over the subset in proportion to its GPUs), as a share of the workload's GPU demand, over the
    model's share of the cluster's GPUs (``supply``: GPUs per model), capped at 1; models no
    constrained shape may use are absent."""
    total_supply = sum(supply.values())
    demand = 0.0
    constrained: dict[str, float] = {}
    for s in shapes:
        d = _gpu_demand(s)
        if not d:
            continue
        demand += d
        allowed = [m for m in dict.fromkeys(s.get("gpuModels") or ()) if supply.get(m)]
        cap = sum(supply[m] for m in allowed)
        for m in allowed:
            constrained[m] = constrained.get(m, 0.0) + d * supply[m] / cap
    if demand <= 0 or total_supply <= 0:
        return {}
    return {m: min(1.0, (c / demand) / (supply[m] / total_supply)) for m, c in constrained.items()}


def workload_memory_per_cpu(parameters: dict[str, Any]) -> float | None:
    """``parameters.memoryPerCpu``, else the target shapes' (weighted) ``memory`` over their
    ``cpu``; None when neither is given (then each request's own ratio applies)."""
    given = parameters.get("memoryPerCpu")
    if isinstance(given, int | float) and given > 0:
        return float(given)
    shapes = parameters.get("workload")
    if isinstance(shapes, list):
        mem = cpu = 0.0
        for s in shapes:
            if isinstance(s, dict) and s.get("memory") is not None:
                w = float(s.get("weight", 0) or 0)
                mem += w * float(s.get("memory") or 0)
                cpu += w * float(s.get("cpu") or 0)
        if mem > 0 and cpu > 0:
            return mem / cpu
    return None


def memory_per_cpu(parameters: dict[str, Any], needs: Needs) -> float:
    """MiB of memory the workload's tasks ask per CPU: ``parameters.memoryPerCpu``, else the
    target shapes' (weighted) ``memory`` over their ``cpu``, else the request's own ratio; 0
    (memory ignored) when none is known."""
    fixed = workload_memory_per_cpu(parameters)
    return fixed if fixed is not None else request_memory_per_cpu(needs)


def request_memory_per_cpu(needs: Needs) -> float:
    """The request's own MiB per CPU (0 when it asks no CPU or no memory)."""
    cpu_asked = float(needs.get("cpu", 0) or 0)
    mem_asked = float(needs.get("memory", 0) or 0)
    return mem_asked / cpu_asked if cpu_asked > 0 and mem_asked > 0 else 0.0


def effective_cpu(cpu_free: float, memory_free: float, ratio: float) -> float:
    """The CPUs a task of the workload could still use: its free CPUs, fewer when its free memory
    would run out first (``ratio`` MiB per CPU; 0: memory ignored)."""
    if ratio <= 0:
        return cpu_free
    return min(cpu_free, memory_free / ratio)


class FillWorkload:
    """A look-ahead fragmentation measure: for each shape of the target workload, the node's free
    GPU compute that shape could *not* use if the node were filled with tasks of that shape
    alone, counting how many fit by GPU (slots on whole GPUs or shares on each GPU) and by CPU
    (effective CPU over the shape's CPUs), weighted by the shapes' frequencies. FGD's measure
    (``frag.Workload``) asks whether *one* task fits; this one asks how much of the node the
    tasks could fill: a node with 8 free GPUs and CPUs for 3 tasks strands 5 GPUs here, none in
    FGD's."""

    def __init__(self, shapes: list[dict[str, Any]]):
        groups: dict[tuple[int, int, tuple[str, ...]], list[tuple[float, float]]] = {}
        self.cpu_only = 0.0
        for s in shapes:
            weight = float(s.get("weight", 0) or 0)
            if weight <= 0:
                continue
            gpus = int(s.get("gpus", 0) or 0)
            if not gpus:
                self.cpu_only += weight
                continue
            share = round(float(s.get("gpuShare") or 0) * UNITS)
            units = share if 0 < share < UNITS else UNITS
            key = (gpus, units, tuple(sorted(s.get("gpuModels") or ())))
            groups.setdefault(key, []).append((float(s.get("cpu", 0) or 0), weight))
        #: (gpus, units, allowed models, [(cpu, weight)], total weight)
        self.groups = [(g, u, frozenset(m), items, sum(w for _, w in items)) for (g, u, m), items in sorted(groups.items())]
        #: the shapes' distinct CPU figures (> 0): a node's CPU enters the measure only as how many
        #: tasks of each fit it (``int((cpu + 1e-9) // c)``), the key of ``_by_level``
        self.cpus = sorted({c for *_, items, _w in self.groups for c, _ in items if c > 0})
        #: (model, exact CPU, free compute per GPU sorted) -> the figure
        self._memo: dict[tuple[Any, ...], float] = {}
        #: (model, tasks of each CPU figure that fit, free compute per GPU sorted) -> the figure:
        #: the same figure for every CPU giving the same counts (the exact CPUs differ per request
        #: shape through the memory ratio; few of them change a count)
        self._by_level: dict[tuple[Any, ...], float] = {}

    def frag(self, model: str, cpu_free: float, left: tuple[int, ...]) -> float:
        """The node's expected GPU compute (thousandths) a workload's shape could not fill."""
        free = sum(left)
        if not free:
            return 0.0
        ordered = tuple(sorted(left))
        key = (model, cpu_free, ordered)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        cpu = cpu_free + 1e-9
        level = (model, tuple([int(cpu // c) for c in self.cpus]), ordered)
        out = self._by_level.get(level)
        if out is None:
            out = self._measure(model, cpu, left, free)
            if len(self._by_level) > 500_000:
                self._by_level.clear()
            self._by_level[level] = out
        if len(self._memo) > 500_000:
            self._memo.clear()
        self._memo[key] = out
        return out

    def _measure(self, model: str, cpu: float, left: tuple[int, ...], free: int) -> float:
        """The figure itself (``cpu``: the node's free CPUs + 1e-9); it reads the CPU only through
        ``int(cpu // c)`` for the shapes' CPU figures ``c`` (the key of ``_by_level``)."""
        out = self.cpu_only * free
        whole = left.count(UNITS)
        partial = [x for x in left if x]
        per_share: dict[int, int] = {}  # shares of one size that fit, per size (shapes repeat sizes)
        for gpus, units, models, items, weight in self.groups:
            if models and model not in models:
                out += weight * free
                continue
            if units < UNITS:
                slots = per_share.get(units, -1)
                if slots < 0:
                    slots = 0
                    for x in partial:
                        slots += x // units
                    per_share[units] = slots
            else:
                slots = whole // gpus
            if not slots:
                out += weight * free
                continue
            for c, w in items:
                k = int(cpu // c) if c > 0 else slots
                out += w * (free - (k if k < slots else slots) * gpus * units)
        return out


class BlendedWorkload:
    """The measure the policy descends: ``(1 - look_ahead)`` x FGD's (one next task) plus
    ``look_ahead`` x :class:`FillWorkload`'s (the node filled with the workload)."""

    def __init__(self, shapes: list[dict[str, Any]], look_ahead: float = 0.5):
        self.fgd, self.fill, self.look_ahead = Workload(shapes), FillWorkload(shapes), look_ahead
        #: (model, CPU, free compute per GPU) -> the blend: one look-up where a node state recurs
        self._memo: dict[tuple[Any, ...], float] = {}

    def frag(self, model: str, cpu_free: float, left: tuple[int, ...]) -> float:
        key = (model, cpu_free, left)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        a = self.look_ahead
        out = 0.0 if a >= 1 else (1 - a) * self.fgd.frag(model, cpu_free, left)
        out += a * self.fill.frag(model, cpu_free, left) if a > 0 else 0.0
        if len(self._memo) > 500_000:
            self._memo.clear()
        self._memo[key] = out
        return out


class FgdPlusPolicy(_FragBase):
    """FGD over effective CPU (memory strands GPUs), best fit on ties, best-fit GPU."""

    mode = "fgd-plus"
    #: keep each node view's measure before a task (per memory ratio) and each score per (node
    #: state, request); off: everything measured per score (the slow path the tests compare the
    #: decisions with)
    memoise = True

    def __init__(self, rule_id: str, settings: dict[str, Any], parameters: dict[str, Any]):
        super().__init__(rule_id, settings, parameters)
        look = self.parameters.get("lookAhead", LOOK_AHEAD)
        self.look_ahead = min(max(float(look), 0.0), 1.0) if isinstance(look, int | float) else LOOK_AHEAD
        self.key = (f"{self.key[0]}@{self.look_ahead}", self.key[1], self.key[2])  # the score memo: per look-ahead
        shapes = self.parameters.get("workload")
        self.shapes = [s for s in shapes if isinstance(s, dict)] if isinstance(shapes, list) else []
        multi = self.parameters.get("multiGpu")
        given: list[dict[str, Any]] = [s for s in multi if isinstance(s, dict)] if isinstance(multi, list) else []
        mw = self.parameters.get("multiGpuWeight", MULTI_GPU_WEIGHT)
        self.multi_weight = max(float(mw), 0.0) if isinstance(mw, int | float) else MULTI_GPU_WEIGHT
        #: the multi-GPU shapes the workload's cut leaves out, their frequencies x ``multi_weight``
        self.multi = [{**s, "weight": float(s.get("weight", 0) or 0) * self.multi_weight}
                      for s in given if int(s.get("gpus", 0) or 0) > 1] if self.multi_weight > 0 else []
        self.key = (f"{self.key[0]}@{self.multi_weight}:{zlib.crc32(repr(self.multi).encode())}", self.key[1], self.key[2])
        self.fill = self.measure(self.shapes + self.multi) if self.shapes else None
        weight = self.parameters.get("modelPressure", MODEL_PRESSURE)
        self.pressure_weight = max(float(weight), 0.0) if isinstance(weight, int | float) else MODEL_PRESSURE
        if not any(s.get("gpuModels") for s in self.shapes):
            self.pressure_weight = 0.0  # no constrained shape: nothing to keep free
        self.key = (f"{self.key[0]}@{self.pressure_weight}", self.key[1], self.key[2])
        packing = self.parameters.get("sharePacking", SHARE_PACKING)
        self.packing = max(float(packing), 0.0) if isinstance(packing, int | float) else SHARE_PACKING
        share_cpu = self.parameters.get("shareCpu", SHARE_CPU)
        self.share_cpu = int(share_cpu) if isinstance(share_cpu, bool | int) else SHARE_CPU
        stranding = self.parameters.get("leftoverCpu", LEFTOVER_CPU)
        self.stranding = max(float(stranding), 0.0) if isinstance(stranding, int | float) else LEFTOVER_CPU
        quantile = self.parameters.get("shareCpuQuantile", 0.0)
        self.quantile = min(max(float(quantile), 0.0), 1.0) if isinstance(quantile, int | float) else 0.0
        self.prices = (SharePrices.of_shapes(self.shapes, self.share_cpu > 0 or self.stranding > 0, self.quantile)
                       if self.packing > 0 else None)
        if self.prices is None:
            self.stranding = 0.0
        self.key = (f"{self.key[0]}@{self.packing}@{self.share_cpu}@{self.stranding}@{self.quantile}", self.key[1], self.key[2])
        host = self.parameters.get("hostPressure", HOST_PRESSURE)
        self.host_weight = max(float(host), 0.0) if isinstance(host, int | float) else HOST_PRESSURE
        host_share = self.parameters.get("hostShare", HOST_SHARE)
        self.host_share = min(max(float(host_share), 0.0), 1.0) if isinstance(host_share, int | float) else HOST_SHARE
        #: the shapes whose demand the host pressure reads (the ``multiGpu`` ones at their own frequency)
        self.host_shapes = self.shapes + given if self.host_weight > 0 else []
        self.key = (f"{self.key[0]}@{self.host_weight}@{self.host_share}", self.key[1], self.key[2])
        #: node class -> (host pressure, CPUs per GPU), made from the first call's nodes
        self.host: dict[tuple[str, int], tuple[float, float]] | None = None
        self.pressure: dict[str, float] | None = None
        #: the workload's memory per CPU when the parameters give it (else each request's own)
        self.ratio = workload_memory_per_cpu(self.parameters)
        #: (node state, request) -> (score, positions of the GPUs chosen): see ``_score``
        self._scores: dict[tuple[Any, ...], tuple[Any, tuple[int, ...]]] = {}

    def measure(self, shapes: list[dict[str, Any]]) -> BlendedWorkload:
        return BlendedWorkload(shapes, self.look_ahead)

    def _pick(
        self, nodes: dict[str, Any], healthy: set[str], needs: Needs, avoid: set[str], seed: str
    ) -> tuple[str, list[str]] | None:
        if self.pressure is None and self.pressure_weight > 0:  # the cluster's GPUs per model, once
            supply: dict[str, int] = {}
            for n in nodes.values():
                if n.get("gpus"):
                    supply[node_model(n)] = supply.get(node_model(n), 0) + len(n["gpus"])
            self.pressure = model_pressure(self.shapes, supply)
        if self.host is None and self.host_shapes:  # the classes the scarce shapes need, once
            self.host = host_pressure(self.host_shapes, list(nodes.values()), self.host_share)
        return super()._pick(nodes, healthy, needs, avoid, seed)

    def _penalty(self, model: str, needs: Needs, taken: int) -> float:
        """What taking ``taken`` thousandths of a ``model`` GPU costs the constrained work: none
        for a task only one model may serve (it has no choice)."""
        if not self.pressure or not taken or len(set(needs.get("gpuModels") or ())) == 1:
            return 0.0
        return self.pressure_weight * self.pressure.get(model, 0.0) * taken

    def _host_cost(self, node: NodeView, needs: Needs, taken: int) -> float:
        """What taking ``taken`` thousandths of GPU compute and the request's CPUs on ``node``
        costs the scarce shapes its class alone holds (rule 8; reads the node's state only)."""
        if not self.host:
            return 0.0
        hit = self.host.get(node_class(node))
        if hit is None:
            return 0.0
        pressure, per_gpu = hit
        cpu = float(needs.get("cpu", 0) or 0)
        return self.host_weight * pressure * max(float(taken), UNITS * cpu / per_gpu if per_gpu > 0 else 0.0)

    def _stranded(self, left: tuple[int, ...], cpu_before: float, cpu_after: float, skip: int = -1) -> float:
        """The share space a task's CPUs leave no share size to fill on its node (GPUs)."""
        return self.prices.stranded(left, cpu_before, cpu_after, skip) if self.prices is not None else 0.0

    @staticmethod
    def _before(wl: BlendedWorkload, node: NodeView, model: str, left: tuple[int, ...], ratio: float) -> float:
        return wl.frag(model, effective_cpu(float(node["cpu_free"]), float(node.get("memory_free", 0)), ratio), left)

    def _score(self, node: NodeView, usable: list[GpuView], needs: Needs, units: int,
               count: int) -> tuple[Any, list[str]]:
        """The score of a node state for a request, once per (state, request): nodes alike (idle
        nodes of one type, nodes filled alike) share it; the GPUs chosen kept as positions."""
        if not self.memoise:
            return self._score_view(node, usable, needs, units, count)
        models = needs.get("gpuModels")
        key = (capacity.state_id(node), needs.get("cpu", 0), needs.get("memory", 0),
               needs.get("gpuMemory", 0), units, count, tuple(models) if models else ())
        hit = self._scores.get(key)
        gpus = node["gpus"]
        if hit is None:
            rank, chosen = self._score_view(node, usable, needs, units, count)
            at = {g["id"]: i for i, g in enumerate(gpus)}
            hit = (rank, tuple(at[c] for c in chosen))
            if len(self._scores) > 500_000:
                self._scores.clear()
            self._scores[key] = hit
        return hit[0], [gpus[i]["id"] for i in hit[1]]

    def _score_view(self, node: NodeView, usable: list[GpuView], needs: Needs, units: int,
                    count: int) -> tuple[Any, list[str]]:
        wl = self.fill
        ratio = self.ratio if self.ratio is not None else request_memory_per_cpu(needs)
        model = node_model(node)
        cpu_ask, mem_ask = float(needs.get("cpu", 0) or 0), float(needs.get("memory", 0) or 0)
        cpu_after = effective_cpu(float(node["cpu_free"]) - cpu_ask, float(node.get("memory_free", 0)) - mem_ask, ratio)
        cpu_before = effective_cpu(float(node["cpu_free"]), float(node.get("memory_free", 0)), ratio)
        left: tuple[int, ...] = capacity.derived(node, "gpu_left", gpu_left)
        if wl is None:  # no target workload: this request's shape alone
            wl = self.measure([{"cpu": needs.get("cpu", 0), "gpus": count or 0,
                                "gpuShare": units / UNITS if units < UNITS else 0, "weight": 1}])
            before = self._before(wl, node, model, left, ratio)
        elif not self.memoise:
            before = self._before(wl, node, model, left, ratio)
        else:  # the node's measure before the task: one figure per view, whatever the task
            before = capacity.derived(node, ("fgd-plus:before", *self.key, ratio),
                                      lambda n: self._before(wl, n, model, left, ratio))
        if not count:  # CPU-only: where its CPUs are least needed by the free GPUs left
            delta = wl.frag(model, cpu_after, left) - before + self._host_cost(node, needs, 0)
            if self.stranding:
                delta += self.stranding * UNITS * self._stranded(left, cpu_before, cpu_after)
            free = sum(left)
            return (round(delta, DIGITS), free, -round(cpu_after * UNITS / free if free else cpu_after, 3)), []
        if units < UNITS:  # one shared GPU: least growth, then the least free compute that fits
            return self._score_share(usable, needs, units, wl, model, left, before, cpu_before, cpu_after,
                                     self._host_cost(node, needs, units))
        chosen = [g["id"] for g in usable[:count]]
        after = list(left)
        for _ in chosen:  # whole GPUs: idle ones, all alike
            after[after.index(UNITS)] = 0
        delta = (wl.frag(model, cpu_after, tuple(after)) - before + self._penalty(model, needs, count * UNITS)
                 + self._host_cost(node, needs, count * UNITS))
        if self.stranding:
            delta += self.stranding * UNITS * self._stranded(left, cpu_before, cpu_after)
        return (round(delta, DIGITS), sum(after), round(cpu_after, 3)), chosen


    def _score_share(self, usable: list[GpuView], needs: Needs, units: int, wl: BlendedWorkload, model: str,
                     left: tuple[int, ...], before: float, cpu_before: float,
                     cpu_after: float, host: float = 0.0) -> tuple[Any, list[str]]:
        """One shared GPU: the least fragmentation growth (with the share prices' loss), then the
        least free compute that fits; one GPU tried per free amount (GPUs alike in it score alike)."""
        best: tuple[float, int, str] | None = None
        cost = self._penalty(model, needs, units) + host
        for g, free, after in share_options(usable, left, units):
            d = wl.frag(model, cpu_after, after) - before + cost
            if self.stranding:
                d += self.stranding * UNITS * self._stranded(left, cpu_before, cpu_after, left.index(free))
            if self.prices is not None:
                d += self.packing * UNITS * self.prices.loss(free, units, cpu_after if self.share_cpu else None,
                                                             cpu_before if self.share_cpu > 1 else None)
            d = round(d, DIGITS)
            if best is None or (d, free) < best[:2]:
                best = (d, free, g["id"])
        assert best is not None
        return (best[0], sum(left) - units, round(cpu_after, 3)), [best[2]]


POLICIES: dict[str, type[FgdPlusPolicy]] = {"builtin:fgd-plus": FgdPlusPolicy}
