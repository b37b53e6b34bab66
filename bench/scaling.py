"""Cost per placement at 100, 1,000 and 10,000 nodes in one cluster: does it grow sub-linearly?

Two views:

* **placement step** (in process): what a controller computes for one 1-instance block — the
  dry_run and the allocation plan through ``handlers.controller`` with the real ``PolicyRuntime``
  and ``builtin:binpack``, plus encoding each policy input as its decision record does — on
  node views shaped by ``state.store.node_view``; each placement is applied to the snapshot the
  way the inventory refreshes it (the node's view replaced). Default settings (nodes sampled above
  ``sampleNodes`` = 100) against ``sampleNodes: 0`` (every node, the pre-sampling cost).
* **end to end**: one cluster of n nodes through the real workers: a burst of blocks, create ->
  ready, reported as ms of wall time per block.

The growth exponent is ``log(cost(10k) / cost(100)) / log(100)``: 1.0 is linear, 0 is flat.
A pyinstrument profile of the 10,000-node placement step is written to
``bench/results/profile_10k.txt`` and its top frames are summarised in a row's note.

    .venv/bin/python -m bench.scaling [--quick]
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from typing import Any

import msgspec

try:
    from . import common, harness, raw
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    import harness  # type: ignore[no-redef]
    import raw  # type: ignore[no-redef]

from aios_blocks.handlers import controller as h
from aios_blocks.policies import capacity
from aios_blocks.policies.builtin.resource import BinPackPolicy
from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.schemas.ir import block_create_IR
from aios_blocks.state.store import node_view

GROUP = "3 scaling (1 cluster)"
CLUSTER = {"id": "c", "labels": {}}


def make_nodes(n: int, gpus: int = 8) -> dict[str, dict[str, Any]]:
    """n node views (through ``node_view``), about a third of their GPUs busy."""
    out = {}
    for i in range(n):
        nid = f"c-n{i}"
        spec = {"id": nid, "cluster": "c", "labels": {"rack": str(i % 4)},
                "gpus": [{"id": f"{nid}-g{g}", "model": "sim", "memory": 81920} for g in range(gpus)]}
        hsh = {"spec": msgspec.json.encode(spec).decode(), "cpu": "64", "memory": str(512 * 1024), "healthy": "1",
               "cpu_used": str(i % 7)}
        for g in range(gpus):
            hsh[f"g:{nid}-g{g}:total"] = "81920"
            if (i + g) % 3 == 0:
                hsh[f"g:{nid}-g{g}:n"], hsh[f"g:{nid}-g{g}:mem"], hsh[f"g:{nid}-g{g}:x"] = "1", "81920", "1"
        out[nid] = node_view(hsh)
    return capacity.Nodes(out)  # as the workers' inventory holds them: views that log their changes


def make_ir(bid: str, sample_nodes: int | None) -> dict[str, Any]:
    settings = {} if sample_nodes is None else {"sampleNodes": sample_nodes}
    comp = {**harness.COMPONENT, "policies": [harness.COMPONENT["policies"][0],
                                              {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "settings": settings}]}
    return block_create_IR({**harness.SPEC, "blockComponentURI": comp["componentURI"]}, comp, bid)


class Step:
    """One controller's placement work for a block, as the worker does it (minus the I/O)."""

    def __init__(self, nodes: dict[str, dict[str, Any]], sample_nodes: int | None, direct: bool = False):
        self.nodes, self.sample_nodes, self.rt, self.i = nodes, sample_nodes, PolicyRuntime(), 0
        self.direct = direct  # call eval() in this thread (for the profiler) instead of the runtime's pool

    def _invoker(self, ir: dict[str, Any]) -> Any:
        rule = ir["policies"]["resourceAllocator"]

        async def call(data: dict[str, Any]) -> Any:
            raw_input = msgspec.json.encode(data)  # the decision record's input (Worker.record)
            hashlib.sha256(raw_input).hexdigest()
            if self.direct:
                return BinPackPolicy("p", rule.get("settings") or {}, {}).eval({}, data, {})
            return await self.rt.invoke(rule, f"{ir['blockId']}.resourceAllocator", data, {})

        return call

    async def once(self) -> None:
        self.i += 1
        ir = make_ir(f"blk-{self.i}", self.sample_nodes)
        invoke = self._invoker(ir)
        out = await h.dry_run(ir, CLUSTER, self.nodes, invoke)
        if out.score <= 0:
            raise RuntimeError(f"dry_run found no room: {out.error}")
        [p] = await h.plan(ir, CLUSTER, self.nodes, "allocation", [h.instance_id(ir["blockId"], 0)], invoke)
        view = capacity.copy_node(self.nodes[p["node"]])  # the inventory replaces a changed view
        capacity.take(view, p["gpus"], ir["resources"], False)
        self.nodes[p["node"]] = view


async def step_cost(n: int, sample_nodes: int | None, repeat: int) -> float:
    step = Step(make_nodes(n), sample_nodes)
    for _ in range(3):
        await step.once()  # warm: policy compiled, totals memo built
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        await step.once()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def profile_summary(n: int, repeat: int) -> str:
    """Top frames (own time) of the placement step at n nodes; full text in results/profile_10k.txt."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        return "pyinstrument not installed (pip install -e '.[dev]')"
    step = Step(make_nodes(n), None, direct=True)
    await step.once()
    prof = Profiler(interval=0.0005, async_mode="disabled")
    prof.start()
    for _ in range(repeat):
        await step.once()
    prof.stop()
    common.RESULTS.mkdir(exist_ok=True)
    (common.RESULTS / "profile_10k.txt").write_text(prof.output_text(unicode=False, color=False, show_all=False))
    own: dict[str, float] = {}

    def walk(frame: Any) -> None:
        if frame.function and frame.file_path_short:
            key = f"{frame.function} ({frame.file_path_short.rsplit('/', 1)[-1]})"
            own[key] = own.get(key, 0.0) + frame.total_self_time
        for child in frame.children:
            walk(child)

    root = prof.last_session.root_frame() if prof.last_session else None
    if root is None:
        return "no samples"
    walk(root)
    total = sum(own.values()) or 1.0
    top = sorted(own.items(), key=lambda kv: -kv[1])[:4]
    return "top own time: " + "; ".join(f"{k} {v / total:.0%}" for k, v in top)


def exponent(c_small: float, c_big: float, ratio: float) -> float:
    return math.log(c_big / c_small) / math.log(ratio) if c_small > 0 and c_big > 0 else float("nan")


async def e2e_cost(n: int, blocks: int) -> tuple[float, float]:
    """ms per block (burst create -> ready) and placements/s of scale calls, one cluster of n nodes."""
    async with harness.stack(1, n, tag="scaling") as st:
        _, secs = await st.burst(blocks, timeout=240)
        targets = [b for b in (await st.burst(4, 120, {**harness.SPEC, "maxInstances": 64}))[0] if st.tracker.done[b][0] == "ready"]
        if not targets:
            return secs / blocks, float("nan")
        placed, _failed, ssecs = await st.scale_burst(targets, blocks, timeout=240)
    return secs / blocks, placed / ssecs


async def measure(quick: bool) -> list[common.Row]:
    sizes = [100, 1000] if quick else [100, 1000, 10000]
    rows: list[common.Row] = []
    step_ms = 1000 / (common.raw(common.JS_STEP) or float("inf"))
    costs: dict[tuple[str, int], float] = {}
    for label, sn in (("sampled (default sampleNodes=100)", None), ("every node (sampleNodes=0)", 0)):
        for n in sizes:
            repeat = 30 if n <= 1000 else (15 if sn is None else 4)
            c = await step_cost(n, sn, 8 if quick else repeat)
            costs[(label, n)] = c
            rows.append(common.row(GROUP, f"placement step at {n:,} nodes, {label}", c * 1000, "ms",
                                   step_ms / (c * 1000) if step_ms else None,
                                   "dry_run + allocation + decision-record encode, in process; of_raw_limit = raw step time / cost"))
        lo, hi = sizes[0], sizes[-1]
        e = exponent(costs[(label, lo)], costs[(label, hi)], hi / lo)
        rows.append(common.row(GROUP, f"growth exponent {lo:,}->{hi:,} nodes, {label}", e, "", None,
                               f"cost x{costs[(label, hi)] / costs[(label, lo)]:.1f} for x{hi // lo} nodes; 1.0 = linear"))
    e2e: dict[int, float] = {}
    for n in sizes:
        blocks = 20 if quick else 40
        per_block, scale_rate = await e2e_cost(n, blocks)
        e2e[n] = per_block
        rows.append(common.row(GROUP, f"end to end at {n:,} nodes: wall time per block (burst)", per_block * 1000, "ms",
                               common.floor_fraction(per_block, 1.0), f"{blocks} blocks at once, create->ready; of_raw_limit = raw step / this"))
        rows.append(common.row(GROUP, f"end to end at {n:,} nodes: scale placements/s", scale_rate, "placements/s",
                               common.fraction(scale_rate, common.JS_STEP), f"{blocks} scale calls at once"))
    lo, hi = sizes[0], sizes[-1]
    rows.append(common.row(GROUP, f"end-to-end growth exponent {lo:,}->{hi:,} nodes", exponent(e2e[lo], e2e[hi], hi / lo), "", None,
                           f"wall time per block x{e2e[hi] / e2e[lo]:.2f} for x{hi // lo} nodes"))
    summary = await profile_summary(hi, 5 if quick else 15)
    rows.append(common.row(GROUP, f"where the time goes at {hi:,} nodes (pyinstrument)", costs[("sampled (default sampleNodes=100)", hi)] * 1000,
                           "ms", None, summary + "; full profile: bench/results/profile_10k.txt"))
    return rows


def figures(quick: bool = False) -> list[common.Row]:
    raw.ensure_raw()
    return common.run(measure(quick))


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
